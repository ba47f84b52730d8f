"""Faults around a real vLLM CPU engine: lost reports, a region that cannot
fit, a kill in the middle of the work, two engines on one host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ectools.engine import (
    TEST_PASSES,
    assert_no_region_left,
    connector_spec,
    finish,
    kill_at,
    launch,
    region_files,
    run_in_subprocess,
)
from ectools.runners import RUNNERS

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("runner", RUNNERS)
def test_lost_load_reports_settle_by_progress_and_outputs_stay_correct(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path, runner: str
) -> None:
    """Workers copy but never report loads: each load settles once its rank reports
    having moved past it, so pins go without waiting for the bound."""
    spec = connector_spec(
        model_dir,
        tmp_path,
        connector="SilentLoadsConnector",
        module_path="ectools.faulty",
        multiprocess=False,
        passes=[*TEST_PASSES, TEST_PASSES[0]],
        runner=runner,
    )
    result = run_in_subprocess(spec)
    assert result["passes"] == [*baseline, baseline[0]]
    counters = result["counters"]
    assert counters["loads_dispatched"] >= 6
    assert counters["loads_by_rank"] == {}, "no load was ever reported"
    settled = counters["loads_completed"]
    assert counters["reports_lost"] == settled
    assert settled >= counters["loads_dispatched"] - counters["in_flight"]
    assert counters["in_flight"] <= 4, "only the last step's loads may still be unsettled"
    assert region_files(tmp_path) == []


@pytest.mark.parametrize("runner", RUNNERS)
def test_failing_load_submissions_fall_back_and_the_engine_survives(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path, runner: str
) -> None:
    """Every batched load raises in the (default, multiprocess) engine: each entry is
    copied synchronously instead, outputs are identical, and the metrics count it."""
    spec = connector_spec(
        model_dir,
        tmp_path,
        connector="FailingLoadsConnector",
        module_path="ectools.faulty",
        metrics=True,
        passes=[*TEST_PASSES, TEST_PASSES[0]],
        runner=runner,
    )
    result = run_in_subprocess(spec)
    assert result["passes"] == [*baseline, baseline[0]]
    metrics = result["metrics"]
    assert metrics["vllm:ec_cpu_loads"] >= 6
    assert metrics["vllm:ec_cpu_load_fallbacks"] == metrics["vllm:ec_cpu_loads"]
    assert "injected load submission failure" in result["log"]
    assert_no_region_left(tmp_path, result["log"])


def test_tensor_parallel_load_failing_on_one_rank_only(
    tp2_model_dir: str, tp2_baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """TP=2, rank 1's batched loads raise: outputs stay identical and the counters
    say that rank 1, and only rank 1, fell back."""
    spec = connector_spec(
        tp2_model_dir,
        tmp_path,
        connector="RankOneFailingLoadsConnector",
        module_path="ectools.faulty",
        tensor_parallel_size=2,
        multiprocess=False,
    )
    result = run_in_subprocess(spec)
    assert result["passes"] == tp2_baseline
    counters = result["counters"]
    loads = counters["loads_completed"]
    assert loads >= 6
    assert counters["load_fallbacks_by_rank"] == {"1": loads}
    assert counters["loads_by_rank"] == {"0": loads, "1": loads}
    assert counters["saves_by_rank"] == {"0": counters["saves_completed"]}
    assert region_files(tmp_path) == []


def test_a_region_larger_than_its_directory_stops_the_engine_clearly(
    model_dir: str, tmp_path: Path
) -> None:
    spec = connector_spec(model_dir, tmp_path, multiprocess=False)
    spec.extra["ec_cpu_bytes"] = "64TiB"
    proc = launch(spec, stderr=subprocess.PIPE, start_new_session=True)
    out, err = finish(proc)
    assert proc.returncode != 0
    assert proc.returncode != -signal.SIGBUS
    output = out + err
    assert "ec_connector_extra_config['ec_cpu_bytes'] asks for" in output
    assert "free" in output
    assert region_files(tmp_path) == [], "nothing may be created"


def test_sigkill_in_the_middle_of_a_workload(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    # Killed in the middle of the second pass: the engine (in-process, so all of it)
    # waits after that pass's first step, its first loads and saves under way and the
    # other requests queued.
    spec = connector_spec(model_dir, tmp_path, multiprocess=False, pause_in_pass=1)
    stale = kill_at(spec, "PAUSED 1")
    assert len(stale) == 1
    assert region_files(tmp_path) == stale, "SIGKILL leaves the file behind"
    result = run_in_subprocess(connector_spec(model_dir, tmp_path, multiprocess=False))
    assert not stale[0].exists(), "the next start reclaims the killed engine's region"
    assert result["passes"] == baseline
    assert region_files(tmp_path) == []


def test_two_engines_on_one_host_get_distinct_regions(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """Both start together over one directory; each has its own file and hits."""
    spec = connector_spec(model_dir, tmp_path, multiprocess=False, passes=TEST_PASSES * 2)
    procs = [launch(spec, stderr=subprocess.DEVNULL, start_new_session=True) for _ in range(2)]
    try:
        outputs = [finish(proc)[0] for proc in procs]  # both waited for before any assertion
    finally:
        for proc in procs:  # the other engine, where one did not end in time
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    results: list[dict[str, Any]] = []
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0
        results.append(json.loads(out.splitlines()[-1][len("RESULT ") :]))
    paths = [r["counters"]["region_path"] for r in results]
    assert paths[0] != paths[1], "two engines must never share a region"
    for result in results:
        assert result["passes"] == baseline * 2
        assert result["counters"]["loads_completed"] >= 6
        assert result["counters"]["stale_dropped"] == 0
        assert result["counters"]["load_fallbacks"] == result["counters"]["saves_failed"] == 0
    assert region_files(tmp_path) == []
