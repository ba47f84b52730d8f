"""bench-serve's workloads have the shapes its docstring promises (seeded, so exactly)."""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serve


def test_chat_sessions_slide_a_window_over_their_images() -> None:
    workload = serve.chat_workload(0)
    assert workload.order == serve.chat_workload(0).order  # seeded
    counts = Counter(workload.order)
    assert set(counts) == set(range(serve.SESSIONS * serve.TURNS))
    # Image t of a session is asked at turns t..t+WINDOW-1 (fewer near the session's end).
    for image, count in counts.items():
        turn = image % serve.TURNS
        assert count == min(serve.WINDOW, serve.TURNS - turn), (image, count)
    # Within one session the images come newest first, turn after turn.
    first_session = [i for i in workload.order if i < serve.TURNS]
    assert first_session[:3] == [0, 1, 0]


def test_the_popular_pool_is_skewed_and_bursty() -> None:
    workload = serve.popular_workload(0)
    assert len(workload.order) == serve.POPULAR_REQUESTS
    base = serve.SESSIONS * serve.TURNS  # after the chat workload's images
    assert all(base <= i < base + serve.POOL for i in workload.order)
    counts = Counter(workload.order)
    assert counts.most_common(1)[0][1] >= 3 * (len(workload.order) / len(counts)) / 2
    repeats_in_a_row = sum(a == b for a, b in zip(workload.order, workload.order[1:], strict=False))
    assert repeats_in_a_row >= serve.BURST_LEN - 1


def test_with_a_plot_both_servers_are_scraped_alike(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--plot` samples /metrics once a second while the workloads run: work the server
    does inside the timed requests, so the server without the tier must carry it too,
    though only the with-tier server's samples are drawn."""
    from ectools import metrics_plot, serving

    scraping: set[int] = set()
    drives: dict[int, list[bool]] = {}
    drawn: list[Path] = []

    class Recorder:
        def __init__(self, port: int, interval_s: float = 1.0) -> None:
            self.port = port
            self.samples: list[object] = []

        def __enter__(self) -> Recorder:
            scraping.add(self.port)
            return self

        def __exit__(self, *exc: object) -> None:
            scraping.discard(self.port)

    async def drive(
        port: int, model: str, urls: list[str], order: list[int], concurrency: int
    ) -> serve.Outcome:
        drives.setdefault(port, []).append(port in scraping)
        return serve.Outcome(
            ttft_s=[0.1] * len(order), answers=dict.fromkeys(range(len(order)), "a"), seconds=1.0
        )

    monkeypatch.setattr(serving, "exit_on_termination", lambda: None)
    monkeypatch.setattr(serving, "start_server", lambda command, log: object())
    monkeypatch.setattr(serving, "wait_healthy", lambda *args, **kwargs: None)
    monkeypatch.setattr(serving, "stop", lambda procs: None)
    monkeypatch.setattr(serving, "tier_metrics", lambda port: {})
    monkeypatch.setattr(serving, "image_url", lambda image: "data:,")
    monkeypatch.setattr(metrics_plot, "Recorder", Recorder)
    monkeypatch.setattr(metrics_plot, "render_svg", lambda *args: drawn.append(args[2]))
    monkeypatch.setattr(serve, "_drive", drive)
    monkeypatch.setattr(serve, "build_tiny_blip2", lambda path, spec: path)
    monkeypatch.setattr(serve, "make_images", lambda count, size, seed: [None] * count)
    monkeypatch.setattr(tempfile, "mkdtemp", lambda prefix: str(tmp_path / "work"))
    (tmp_path / "work").mkdir()
    plot = tmp_path / "plot.svg"
    monkeypatch.setattr(sys, "argv", ["serve.py", "--plot", str(plot), "--model-dir", "m"])
    serve.main()
    assert len(drives) == 2  # one server per side
    without, with_tier = drives.values()
    assert with_tier == without, "one side was scraped during its workloads, the other not"
    assert drawn == [plot]  # only the with-tier server's samples are drawn
