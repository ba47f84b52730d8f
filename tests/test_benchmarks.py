"""What the benchmark scripts tell an operator when something goes wrong (no benchmark
is run: each test drives the smallest piece with stand-ins)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import p2p


def test_p2p_shows_why_its_measuring_process_failed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each transport is measured in a fresh interpreter whose output is captured; when
    # it fails (no NIXL, UCX refusing, a port taken), its error must reach the operator.
    inner = tmp_path / "inner.py"
    inner.write_text(
        "import sys\nsys.stderr.write('UCX: no transport is usable\\n')\nsys.exit(3)\n"
    )
    monkeypatch.setattr(p2p, "__file__", str(inner))
    with pytest.raises(SystemExit) as failed:
        p2p.table(repeats=1)
    assert failed.value.code != 0
    assert "UCX: no transport is usable" in capsys.readouterr().err
