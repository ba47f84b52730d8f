"""The connector inside a real vLLM CPU engine with a tiny random-weight BLIP-2.

Every engine runs in a fresh process (`python -m ectools.engine SPEC`). vLLM's
own encoder cache holds 4 images (max_num_batched_tokens=32, 8 embeddings per
image) and prefix caching is off, so a second pass over 10 images can only be
served by re-encoding or by the region. Tests parametrised by `runner` run on
vLLM's V1 and V2 model runners (`ectools.runners`); the rest on V1.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ectools.engine import (
    TEST_PASSES,
    assert_no_region_left,
    connector_spec,
    kill_at,
    region_files,
    run_in_subprocess,
)
from ectools.runners import RUNNERS

pytestmark = pytest.mark.engine


def test_outputs_are_token_identical_with_the_one_connector_name(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """The default multiprocess engine, configured with `ec_connector:
    "ECCPUTierConnector"` alone: the CPU platform picks the CPU backend. Its
    metrics are read from the front end."""
    spec = connector_spec(model_dir, tmp_path, metrics=True)
    result = run_in_subprocess(spec)
    assert result["passes"] == baseline
    assert len(result["region_files_while_running"]) == 1
    assert_no_region_left(tmp_path, result["log"])
    startup = re.findall(
        r"EC CPU tier: connector=ECCPUTierConnector role=ec_both "
        r"backend=CpuECCPUWorker policy=wtinylfu region=(\S+) size=\S+ \S+ "
        r"blocks=(\d+) block_bytes=512",
        result["log"],
    )
    assert len(startup) == 1, "one start-up line with path, size, geometry, role, backend, policy"
    assert startup[0][0] == str(tmp_path / result["region_files_while_running"][0])
    metrics = result["metrics"]
    assert metrics["vllm:ec_cpu_hits"] >= 6
    assert metrics["vllm:ec_cpu_loads"] == metrics["vllm:ec_cpu_hits"]
    assert metrics["vllm:ec_cpu_saves"] >= 10
    assert metrics["vllm:ec_cpu_bytes_saved"] == metrics["vllm:ec_cpu_saves"] * 8 * 512
    assert metrics["vllm:ec_cpu_bytes_loaded"] == metrics["vllm:ec_cpu_loads"] * 8 * 512
    assert (
        metrics["vllm:ec_cpu_misses"]
        == metrics["vllm:ec_cpu_lookups"] - metrics["vllm:ec_cpu_hits"]
    )
    assert metrics["vllm:ec_cpu_region_blocks"] == int(startup[0][1])
    assert metrics["vllm:ec_cpu_region_entries"] >= 10
    assert metrics["vllm:ec_cpu_reclaimed"] == metrics["vllm:ec_cpu_saves_failed"] == 0
    assert metrics["vllm:ec_cpu_load_fallbacks"] == metrics["vllm:ec_cpu_reports_lost"] == 0


@pytest.mark.parametrize("runner", RUNNERS)
def test_second_sightings_are_loads_under_the_old_per_backend_name(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path, runner: str
) -> None:
    """Engine core in-process (its counters are readable), configured the way the CPU
    backend was before the one name: `CpuECCPUConnector` with its module path. On both
    of vLLM's model runners, against the baseline's (V1) outputs."""
    spec = connector_spec(
        model_dir,
        tmp_path,
        connector="CpuECCPUConnector",
        module_path="ec_worker_cpu",
        multiprocess=False,
        runner=runner,
    )
    result = run_in_subprocess(spec)
    assert result["runner"] == runner
    assert "connector=CpuECCPUConnector role=ec_both backend=CpuECCPUWorker" in result["log"]
    assert result["passes"] == baseline
    counters = result["counters"]
    assert counters is not None
    assert counters["saves_completed"] >= 10
    # Every second-pass image vLLM had forgotten came from the region: no re-encode.
    assert counters["loads_completed"] >= 6
    assert counters["hits"] == counters["loads_dispatched"] == counters["loads_completed"]
    assert counters["saves_failed"] == counters["load_fallbacks"] == 0
    assert counters["saves_reclaimed"] == counters["loads_reclaimed"] == 0
    assert region_files(tmp_path) == []


@pytest.mark.parametrize("runner", RUNNERS)
def test_reloads_use_the_region_bytes(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path, runner: str
) -> None:
    """Overwriting the region between passes changes exactly what was reloaded."""
    spec = connector_spec(model_dir, tmp_path, corrupt_after_pass=0, runner=runner)
    result = run_in_subprocess(spec)
    assert result["corrupted_files"] == 1
    assert result["passes"][0] == baseline[0]
    changed = sum(a != b for a, b in zip(result["passes"][1], baseline[1], strict=True))
    assert changed >= 6, f"only {changed} second-pass outputs changed"


def test_sigkilled_engine_leaves_no_stale_file_after_the_next_start(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    stale = kill_at(connector_spec(model_dir, tmp_path, hold_after_pass=0), "READY")
    assert len(stale) == 1, "the running engine maps exactly one region"
    assert region_files(tmp_path) == stale, "SIGKILL leaves the file behind"

    result = run_in_subprocess(connector_spec(model_dir, tmp_path, multiprocess=False))
    running = result["region_files_while_running"]
    assert len(running) == 1 and running[0] != stale[0].name
    assert not stale[0].exists(), "the next engine must reclaim the dead engine's file"
    assert result["passes"] == baseline
    assert region_files(tmp_path) == []


def test_tensor_parallel_two_ranks_rank_zero_saves_both_load(
    tp2_model_dir: str, tp2_baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """TP=2 (two worker processes over one region): outputs as without the tier,
    only rank 0 writes, every load is performed and acknowledged by both ranks."""
    result = run_in_subprocess(
        connector_spec(tp2_model_dir, tmp_path, tensor_parallel_size=2, multiprocess=False)
    )
    assert result["passes"] == tp2_baseline
    counters = result["counters"]
    loads = counters["loads_completed"]
    assert loads >= 6 and loads == counters["loads_dispatched"] == counters["hits"]
    assert counters["saves_by_rank"] == {"0": counters["saves_completed"]}
    assert counters["saves_completed"] >= 10
    assert counters["loads_by_rank"] == {"0": loads, "1": loads}
    assert counters["load_fallbacks"] == counters["reports_lost"] == 0
    assert region_files(tmp_path) == []


SALT_A, SALT_B = "tenant-A-7f3e91", "tenant-B-c2a0d4"


def test_cache_salts_isolate_tenants_in_one_engine(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """The ten images for salt A, then for salt B, A again, then without a salt. B is
    never served A's entries (it encodes every image vLLM's own encoder cache, which
    keys by identifier alone, does not still hold), A again loads its own, and the
    unsalted pass sees neither. Outputs are token-identical to an engine without the
    tier, and no salt reaches the log, the counters or the metrics."""
    passes = [TEST_PASSES[0]] * 4
    spec = connector_spec(
        model_dir,
        tmp_path,
        multiprocess=False,
        passes=passes,
        cache_salts=[SALT_A, SALT_B, SALT_A, None],
    )
    result = run_in_subprocess(spec)
    assert result["passes"] == [baseline[0]] + [baseline[1]] * 3
    encoded, hits = result["encoded_per_pass"], result["hits_per_pass"]
    assert encoded[0] == 10 and hits[0] == 0
    # vLLM's own cache may still hold a few images (at most 4): those it serves itself.
    assert hits[1] == 0 and encoded[1] >= 6, "salt B encodes: A's entries are not B's"
    assert hits[2] >= 6 and encoded[2] == 0, "salt A again: its own entries"
    assert hits[3] == 0 and encoded[3] >= 6, "no salt: none of the salted entries"
    counters = result["counters"]
    assert counters["saves_completed"] == 10 + encoded[1] + encoded[3]
    assert counters["saves_failed"] == counters["load_fallbacks"] == 0
    everything = json.dumps({key: value for key, value in result.items() if key != "log"})
    for salt in (SALT_A, SALT_B):
        assert salt not in result["log"] and salt not in everything
    assert region_files(tmp_path) == []
