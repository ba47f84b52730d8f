"""Which worker rank writes saves, read from vLLM's process groups."""

from __future__ import annotations

import types

import pytest

from ec_core.worker_process.ranks import detect_rank_info


def _groups(monkeypatch: pytest.MonkeyPatch, *, rank: int, tp: int, pp: int) -> None:
    """vLLM's process groups for one rank of an engine with tensor size 2, no context
    parallelism, and pipeline stages (`tp`, `pp`: this rank's place in each)."""
    from vllm.distributed import parallel_state as ps

    monkeypatch.setattr(ps, "get_world_group", lambda: types.SimpleNamespace(rank=rank))
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: tp)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 2)
    pcp = types.SimpleNamespace(rank_in_group=0, world_size=1)
    monkeypatch.setattr(ps, "get_pcp_group", lambda: pcp, raising=False)
    monkeypatch.setattr(ps, "get_pp_group", lambda: types.SimpleNamespace(rank_in_group=pp))


@pytest.mark.parametrize(
    ("rank", "tp", "pp", "saves"),
    [(0, 0, 0, True), (1, 1, 0, False), (2, 0, 1, False), (3, 1, 1, False)],
)
def test_only_the_first_rank_of_the_first_pipeline_stage_saves(
    monkeypatch: pytest.MonkeyPatch, rank: int, tp: int, pp: int, saves: bool
) -> None:
    """An encode-only engine on vLLM's V1 runner runs the connector on every pipeline
    stage: the first tensor rank of a later stage must not write the blocks the first
    stage's writes (nor report a save it failed, freeing blocks still being written)."""
    _groups(monkeypatch, rank=rank, tp=tp, pp=pp)
    info = detect_rank_info()
    assert (info.rank, info.is_save_rank, info.group_size) == (rank, saves, 2)
