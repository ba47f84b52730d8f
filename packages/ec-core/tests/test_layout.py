"""Region layout and create_ec_shared_region, from real vLLM configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ec_core.layout import create_ec_shared_region, region_layout
from ectools.configs import make_vllm_config

WIDTH = 128  # the tiny BLIP-2's text hidden size


def test_layout_from_config(tiny_model_dir: str, tmp_path: Path) -> None:
    config = make_vllm_config(
        tiny_model_dir, extra={"ec_cpu_bytes": 10_000, "ec_cpu_dir": str(tmp_path)}
    )
    layout = region_layout(config)
    assert layout.dtype == torch.float32
    assert layout.embed_width == WIDTH
    assert layout.block_size_bytes == WIDTH * 4
    assert layout.num_blocks == 10_000 // (WIDTH * 4)  # remainder unused
    assert layout.engine_id == f"{config.instance_id}_dp0"
    assert layout.owner == config.ec_transfer_config.engine_id  # type: ignore[union-attr]
    assert layout.settings.region_dir == tmp_path
    assert layout.blocks_for(8, WIDTH, 4) == 8
    assert layout.blocks_for(3, 100, 4) == 3  # 1200 bytes over 512-byte blocks
    assert layout.blocks_for(0, WIDTH, 4) == 0


def test_bfloat16_halves_the_block(tiny_model_dir: str, tmp_path: Path) -> None:
    config = make_vllm_config(
        tiny_model_dir,
        dtype="bfloat16",
        extra={"ec_cpu_bytes": "1MiB", "ec_cpu_dir": str(tmp_path)},
    )
    layout = region_layout(config)
    assert layout.block_size_bytes == WIDTH * 2
    assert layout.num_blocks == 1024**2 // (WIDTH * 2)


def test_factory_creates_then_joins_the_same_region(tiny_model_dir: str, tmp_path: Path) -> None:
    config = make_vllm_config(
        tiny_model_dir, extra={"ec_cpu_bytes": "64KiB", "ec_cpu_dir": str(tmp_path)}
    )
    first = create_ec_shared_region(config)
    second = create_ec_shared_region(config)
    try:
        assert first.is_creator and not second.is_creator
        assert first.path == second.path
        assert first.blocks.shape == (64 * 1024 // (WIDTH * 4), WIDTH * 4)
        first.blocks[2].fill_(11)
        assert int(second.blocks[2, 7]) == 11
    finally:
        second.cleanup()
        first.cleanup()
    assert list(tmp_path.iterdir()) == []


def test_bad_settings_raise_before_any_file(tiny_model_dir: str, tmp_path: Path) -> None:
    config = make_vllm_config(
        tiny_model_dir, extra={"ec_cpu_bytes": "12 apples", "ec_cpu_dir": str(tmp_path)}
    )
    with pytest.raises(ValueError, match=r"\['ec_cpu_bytes'\] = '12 apples' is invalid"):
        create_ec_shared_region(config)
    assert list(tmp_path.iterdir()) == []


def test_smaller_than_one_block(tiny_model_dir: str, tmp_path: Path) -> None:
    config = make_vllm_config(
        tiny_model_dir, extra={"ec_cpu_bytes": 511, "ec_cpu_dir": str(tmp_path)}
    )
    with pytest.raises(ValueError, match="smaller than one block"):
        create_ec_shared_region(config)
    assert list(tmp_path.iterdir()) == []


def test_needs_an_ec_transfer_config(tiny_model_dir: str) -> None:
    config = make_vllm_config(tiny_model_dir, role=None)
    with pytest.raises(ValueError, match="ec_transfer_config"):
        region_layout(config)


@pytest.mark.parametrize(
    ("nnodes", "tp", "pcp", "pp", "refused"),
    [
        (2, 2, 1, 1, True),  # one tensor-parallel group over two hosts
        (2, 1, 2, 1, True),  # one context-parallel group over two hosts
        (4, 4, 1, 2, True),  # 4 copying ranks, 2 ranks a host
        (2, 4, 2, 2, False),  # 8 copying ranks, 8 ranks a host: a stage per host
        (2, 2, 1, 2, False),  # pipeline stages across hosts, each group within one
        (1, 8, 1, 1, False),  # one host
    ],
)
def test_copying_ranks_spread_over_hosts_are_refused_naming_the_layout(
    tiny_model_dir: str, tmp_path: Path, nnodes: int, tp: int, pcp: int, pp: int, refused: bool
) -> None:
    """A rank on another host than the saving rank would map a region of its own there
    and load bytes nobody saved, silently: such a layout must fail at start-up."""
    config = make_vllm_config(
        tiny_model_dir, extra={"ec_cpu_bytes": "64KiB", "ec_cpu_dir": str(tmp_path)}
    )
    parallel = config.parallel_config
    # vLLM checks these against the devices it sees; the layout check reads them only.
    parallel.nnodes = nnodes
    parallel.tensor_parallel_size = tp
    parallel.prefill_context_parallel_size = pcp
    parallel.pipeline_parallel_size = pp
    parallel.world_size = tp * pcp * pp
    if refused:
        spread = rf"ranks that copy entries on one host.*{nnodes} hosts"
        with pytest.raises(ValueError, match=spread):
            region_layout(config)
    else:
        assert region_layout(config).num_blocks > 0
