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


def test_policy_playback_takes_the_recorded_decisions_and_refuses_others() -> None:
    # `scheduler_cost.py --policy-share` times the scheduler with its policy's answers
    # played back; that is the same work minus the policy's only if the played-back run
    # asks exactly the recorded questions.
    import scheduler_cost

    config = scheduler_cost._config(None)
    answers = scheduler_cost.recorded_answers(config, 128)
    assert len(answers) > 100 and any(isinstance(answer, list) for answer in answers)
    assert scheduler_cost.played_back_us(config, 128, answers.copy()) > 0
    answers.popleft()  # a recording one answer short: every later question is off by one
    with pytest.raises(AssertionError, match="playback was asked"):
        scheduler_cost.played_back_us(config, 128, answers)
