"""An EC consumer's request whose item carries metadata alone, for an encoder
output no engine holds, on a real vLLM CPU engine (a tiny Qwen2-Audio: BLIP-2
takes no metadata-only items)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ectools.engine import ROOT, SUBPROCESS_TIMEOUT, engine_env
from ectools.tiny_qwen2audio import build_tiny_qwen2audio

pytestmark = pytest.mark.engine


def test_a_metadata_only_item_no_one_holds_fails_its_request_and_the_engine_serves_on(
    tmp_path: Path,
) -> None:
    """vLLM lets such an item through to the encoder unless the connector reports
    its request unavailable; encoded without input, the model runner fails and the
    engine dies for every request (EngineDeadError)."""
    model_dir = build_tiny_qwen2audio(tmp_path / "tiny-qwen2-audio")
    region_dir = tmp_path / "region"
    region_dir.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "ectools.tiny_qwen2audio", str(model_dir), str(region_dir)],
        capture_output=True,
        text=True,
        env=engine_env(),
        cwd=ROOT,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"engine failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["metadata_only"] == {"finish_reason": "error", "token_ids": []}, result
    assert result["with_audio"]["finish_reason"] == "length", result
    assert len(result["with_audio"]["token_ids"]) == 4
