"""PeerCounters: counted by the fetcher and the scheduler thread, read when stats are published."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from ec_transfer_nixl import counters as counters_module
from ec_transfer_nixl.counters import PeerCounters


@pytest.fixture
def eager_thread_switches() -> Iterator[None]:
    """Switch threads as often as the interpreter allows, as a busy engine might."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.usefixtures("eager_thread_switches")
def test_fallbacks_counted_from_two_threads_lose_no_increment() -> None:
    # The fetcher thread counts "incompatible" answers; the scheduler thread counts
    # handles that name an incompatible engine. Both land in the same cause.
    counters = PeerCounters()
    per_thread = 100_000

    def count() -> None:
        for _ in range(per_thread):
            counters.fell_back("incompatible")

    threads = [threading.Thread(target=count) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counters.fallbacks == {"incompatible": 4 * per_thread}
    assert counters.totals()["remote_fallbacks:incompatible"] == 4 * per_thread


def test_totals_survive_a_new_cause_counted_while_they_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The scheduler thread publishes stats while the fetcher counts a cause it has
    # not counted before: the thread switch is placed between two causes here.
    counters = PeerCounters()
    counters.fell_back("missing")
    counters.fell_back("shape")
    real_key = counters_module.labelled_key
    switched: list[bool] = []

    def key_then_switch(family: str, *values: object) -> str:
        if not switched:
            switched.append(True)
            fetcher = threading.Thread(target=counters.fell_back, args=("timeout",))
            fetcher.start()
            fetcher.join(timeout=60)  # CI slack: it normally ends within microseconds
            assert not fetcher.is_alive()
        return real_key(family, *values)

    monkeypatch.setattr(counters_module, "labelled_key", key_then_switch)
    totals = counters.totals()  # no "dictionary changed size during iteration"
    assert totals["remote_fallbacks:missing"] == 1 and totals["remote_fallbacks:shape"] == 1
    assert counters.totals()["remote_fallbacks:timeout"] == 1
