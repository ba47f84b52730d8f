"""bench-serve's workloads have the shapes its docstring promises (seeded, so exactly)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

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
