"""The demos' model folder (kept under build/ across runs) is rebuilt when the build
that wrote it was cut short, and reused when it finished."""

from __future__ import annotations

from pathlib import Path

from ectools.tiny_blip2 import build_tiny_blip2


def test_a_build_cut_short_is_redone_and_a_finished_one_reused(tmp_path: Path) -> None:
    out = build_tiny_blip2(tmp_path / "model")
    weights = out / "model.safetensors"
    size = weights.stat().st_size
    assert not (out / ".building").exists()
    finished_at = weights.stat().st_mtime_ns
    assert build_tiny_blip2(out) == out
    assert weights.stat().st_mtime_ns == finished_at  # reused, not rebuilt

    # Killed while writing the weights: config.json and part of the weights are there.
    (out / ".building").touch()
    with weights.open("r+b") as handle:
        handle.truncate(size // 3)
    for name in ("tokenizer.json", "processor_config.json"):
        (out / name).unlink(missing_ok=True)
    build_tiny_blip2(out)
    assert weights.stat().st_size == size
    assert (out / "tokenizer.json").exists() and (out / "processor_config.json").exists()
    assert not (out / ".building").exists()
