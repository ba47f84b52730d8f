"""The connector inside a real vLLM CPU engine with a tiny random-weight BLIP-2.

Every engine runs in a fresh process (`python -m ectools.engine SPEC`). vLLM's
own encoder cache holds 4 images (max_num_batched_tokens=32, 8 embeddings per
image) and prefix caching is off, so a second pass over 10 images can only be
served by re-encoding or by the region.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ectools.engine import EngineSpec, region_files, spec_json
from ectools.tiny_blip2 import build_tiny_blip2

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
IMAGES = list(range(10))
PASSES = [IMAGES, IMAGES]
TIMEOUT = 900


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "tools"), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run_engine(spec: EngineSpec) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "ectools.engine", spec_json(spec)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
        cwd=ROOT,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"engine failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_blip2(tmp_path_factory.mktemp("tiny-blip2")))


@pytest.fixture(scope="module")
def baseline(model_dir: str) -> list[list[list[int]]]:
    result = run_engine(EngineSpec(model_dir=model_dir, passes=PASSES))
    passes: list[list[list[int]]] = result["passes"]
    assert len({tuple(tokens) for tokens in passes[0]}) >= 8, "images must give distinct outputs"
    return passes


def _with_connector(model_dir: str, region_dir: Path, **changes: Any) -> EngineSpec:
    spec = EngineSpec(
        model_dir=model_dir,
        passes=PASSES,
        connector="CpuECCPUConnector",
        module_path="ec_worker_cpu",
        extra={"ec_cpu_bytes": "4MiB", "ec_cpu_dir": str(region_dir)},
    )
    return replace(spec, **changes)


def test_outputs_are_token_identical_with_the_connector(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    result = run_engine(_with_connector(model_dir, tmp_path))
    assert result["passes"] == baseline
    assert len(result["region_files_while_running"]) == 1
    assert region_files(tmp_path) == [], "a clean shutdown must remove the region file"


def test_second_sightings_are_loads_registered_name_in_process(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """Engine core in-process (its counters are readable); connector by name only."""
    result = run_engine(_with_connector(model_dir, tmp_path, module_path=None, multiprocess=False))
    assert result["passes"] == baseline
    counters = result["counters"]
    assert counters is not None
    assert counters["saves_completed"] >= 10
    # Every second-pass image vLLM had forgotten came from the region: no re-encode.
    assert counters["loads_completed"] >= 6
    assert counters["hits"] == counters["loads_dispatched"] == counters["loads_completed"]
    assert counters["saves_failed"] == counters["loads_failed"] == 0
    assert counters["saves_reclaimed"] == counters["loads_reclaimed"] == 0
    assert region_files(tmp_path) == []


def test_reloads_use_the_region_bytes(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """Overwriting the region between passes changes exactly what was reloaded."""
    result = run_engine(_with_connector(model_dir, tmp_path, corrupt_after_pass=0))
    assert result["corrupted_files"] == 1
    assert result["passes"][0] == baseline[0]
    changed = sum(a != b for a, b in zip(result["passes"][1], baseline[1], strict=True))
    assert changed >= 6, f"only {changed} second-pass outputs changed"


def test_sigkilled_engine_leaves_no_stale_file_after_the_next_start(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    spec = _with_connector(model_dir, tmp_path, hold_after_pass=0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ectools.engine", spec_json(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + TIMEOUT
        for line in proc.stdout:
            if line.startswith("READY") or time.monotonic() > deadline:
                break
        stale = region_files(tmp_path)
        assert len(stale) == 1, "the running engine maps exactly one region"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
    time.sleep(1)  # let the kernel reap the engine's worker processes
    assert region_files(tmp_path) == stale, "SIGKILL leaves the file behind"

    result = run_engine(_with_connector(model_dir, tmp_path, multiprocess=False))
    running = result["region_files_while_running"]
    assert len(running) == 1 and running[0] != stale[0].name
    assert not stale[0].exists(), "the next engine must reclaim the dead engine's file"
    assert result["passes"] == baseline
    assert region_files(tmp_path) == []
