"""`ectools.engine.assert_no_region_left`: a file left after an engine's run fails the
test, unless vLLM's log shows it SIGKILLed an engine core that never ran its SIGTERM
handler; that file must then be reclaimed by the next region created there. No engine:
region files are made by hand or by a live region of this process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ec_core.region.mapping import ECSharedRegion
from ectools.engine import (
    VLLM_FORCE_KILLED,
    VLLM_SIGNAL_SEEN,
    assert_no_region_left,
    region_files,
)

FORCE_KILLED_LOG = f"... INFO [utils.py:628] send sigterm\n... WARNING {VLLM_FORCE_KILLED} pid 7\n"


def _dead_engines_file(directory: Path) -> Path:
    """What a SIGKILLed engine leaves: a region file of this user that nobody locks."""
    path = directory / "ec_cpu_tier_1_dp0_0123456789abcdef.mmap"
    path.write_bytes(b"\0" * 8192)
    os.chmod(path, 0o600)
    return path


def test_nothing_left_passes(tmp_path: Path) -> None:
    assert_no_region_left(tmp_path, "")


def test_a_file_left_by_a_shutdown_that_began_fails_with_the_log(tmp_path: Path) -> None:
    _dead_engines_file(tmp_path)
    log = f"{VLLM_SIGNAL_SEEN}=SIGTERM\n{FORCE_KILLED_LOG}"
    with pytest.raises(AssertionError, match="clean shutdown must remove"):
        assert_no_region_left(tmp_path, log)
    with pytest.raises(AssertionError, match="the engine's log ends"):
        assert_no_region_left(tmp_path, "an engine that exited on its own\n")


def test_the_file_of_an_engine_core_vllm_killed_unsignalled_is_reclaimed(
    tmp_path: Path,
) -> None:
    path = _dead_engines_file(tmp_path)
    assert_no_region_left(tmp_path, FORCE_KILLED_LOG)
    assert not path.exists()
    assert region_files(tmp_path) == []


def test_a_file_still_mapped_is_no_killed_engines_and_fails(tmp_path: Path) -> None:
    with ECSharedRegion("alive", 1, 4096, directory=tmp_path) as live:
        with pytest.raises(AssertionError, match="left"):
            assert_no_region_left(tmp_path, FORCE_KILLED_LOG)
        assert live.path.exists()
