"""Timing in turns: the one loop the benchmarks and the device checks time their sides with."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def _no_sync() -> None:
    return None


def medians_in_turns(
    fns: Sequence[Callable[[], object]], repeats: int, sync: Callable[[], None] = _no_sync
) -> list[float]:
    """Median seconds of each function over `repeats` rounds, one call of each per round.

    Each function is called once first (warm-up). `sync` runs before and after every
    timed call (a device synchronise; nothing for host work), so asynchronous work is
    inside its own call's time. Timing in turns makes a noisy neighbour slow every side
    alike.
    """
    for fn in fns:
        fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for index, fn in enumerate(fns):
            sync()
            began = time.perf_counter()
            fn()
            sync()
            times[index].append(time.perf_counter() - began)
    return [statistics.median(t) for t in times]
