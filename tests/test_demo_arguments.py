"""The demos refuse arguments they cannot report on before they start any engine
(each engine start costs the operator many seconds to minutes)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import demo
import demo_epd
from ectools import serving


def _fake_result(passes: int) -> dict[str, Any]:
    return {
        "counters": {},
        "encoded_items": 0,
        "ready_after_launch_s": 1.0,
        "pass_seconds": [1.0] * passes,
        "passes": [[1]] * passes,
    }


@pytest.mark.parametrize("argv", [["--passes", "1"], ["--passes", "0"], ["--images", "0"]])
def test_demo_refuses_a_workload_it_cannot_time_before_starting_an_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str]
) -> None:
    started: list[str] = []

    def run_engine(spec: Any, label: str, ticker: Any) -> dict[str, Any]:
        started.append(label)
        return _fake_result(len(spec.passes))

    monkeypatch.setattr(demo, "run_engine", run_engine)
    monkeypatch.setattr(demo, "build_tiny_blip2", lambda path, spec: path)
    monkeypatch.setattr(sys, "argv", ["demo.py", "--model-dir", str(tmp_path), *argv])
    with pytest.raises(SystemExit) as refused:
        demo.main()
    assert refused.value.code == 2  # argparse's usage error
    assert started == []


def test_demo_epd_refuses_no_images_before_starting_a_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started: list[object] = []

    def start_server(command: list[str], log: Any) -> Any:
        started.append(command)
        raise RuntimeError("no server in this test")

    monkeypatch.setattr(serving, "exit_on_termination", lambda: None)
    monkeypatch.setattr(serving, "start_server", start_server)
    monkeypatch.setattr(demo_epd, "build_tiny_blip2", lambda path, spec: path)
    monkeypatch.setattr(sys, "argv", ["demo_epd.py", "--model-dir", str(tmp_path), "--images", "0"])
    with pytest.raises(SystemExit) as refused:
        demo_epd.main()
    assert refused.value.code == 2
    assert started == []


def _metrics(lookups: float, hits: float, remote_hits: float = 0.0) -> dict[str, float]:
    return {
        "vllm:ec_cpu_lookups_total": lookups,
        "vllm:ec_cpu_hits_total": hits,
        "vllm:ec_cpu_remote_hits_total": remote_hits,
    }


def test_demo_epd_prints_the_encoder_runs_it_measured_on_both_sides(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The prefill instance alone encoded 3 of the 4 images (vLLM's own encoder cache
    # held one: no lookup, no encode); through the proxy, 4 were fetched and hit.
    proxy = SimpleNamespace(stage_seconds=[(0.1, 0.05)] * 4, handles_forwarded=4)
    demo_epd._print_table(
        4,
        epd=[("x", 0.2)] * 4,
        alone=[("x", 0.3)] * 4,
        proxy=proxy,  # type: ignore[arg-type]
        before=_metrics(10, 0),
        after=_metrics(14, 4, remote_hits=4),
        alone_before=_metrics(0, 0),
        alone_after=_metrics(3, 0),
    )
    cells = [re.split(r"\s{2,}", line.strip()) for line in capsys.readouterr().out.splitlines()]
    rows = {row[0]: row[1:] for row in cells}
    assert rows["encoder runs on the prefill instance"] == ["0", "3"]
    assert rows["encoder runs avoided on the prefill instance"] == ["4", "0"]


def test_the_epd_proxy_asks_the_encoder_for_one_sample() -> None:
    """With `n` > 1 vLLM runs each sample as a request of its own: on an encoder with
    handle leases each would pin the same entries under its own lease, and the
    response carries one handle, so the others stay pinned, unclaimed, until they
    expire. The proxy sends the encoder one sample; the prefill instance gets `n`."""
    sent: list[tuple[str, dict[str, Any]]] = []

    class Client:
        def post(self, url: str, json: dict[str, Any]) -> Any:
            sent.append((url, json))
            answer = {"ec_transfer_params": {"ec_cpu_tier": {}}}
            return SimpleNamespace(status_code=200, json=lambda: answer)

    proxy = demo_epd.Proxy.__new__(demo_epd.Proxy)
    proxy.encoder, proxy.prefill, proxy.client = "http://e", "http://p", Client()
    proxy.stage_seconds, proxy.handles_forwarded = [], 0
    proxy.forward("/v1/chat/completions", {"n": 3, "max_tokens": 8})
    (encoder, first), (prefill, second) = sent
    assert encoder.startswith("http://e") and (first["n"], first["max_tokens"]) == (1, 1)
    assert prefill.startswith("http://p") and (second["n"], second["max_tokens"]) == (3, 8)
