"""The demos' model folder (kept under build/ across runs) is rebuilt when the build
that wrote it was cut short, and reused when it finished."""

from __future__ import annotations

from pathlib import Path

from ectools.model_build import check_reused_and_redone
from ectools.tiny_blip2 import build_tiny_blip2


def test_a_build_cut_short_is_redone_and_a_finished_one_reused(tmp_path: Path) -> None:
    check_reused_and_redone(build_tiny_blip2, tmp_path / "model")
