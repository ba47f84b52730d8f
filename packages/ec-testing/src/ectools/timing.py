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
    alike; the order rotates from round to round, so the cache state one function leaves
    favours no other.
    """
    for fn in fns:
        fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    order = list(enumerate(fns))
    for round_number in range(repeats):
        # Each round starts one function later, so every function follows every
        # other equally often: none always runs in the caches its predecessor left.
        shift = round_number % len(order)
        for index, fn in order[shift:] + order[:shift]:
            sync()
            began = time.perf_counter()
            fn()
            sync()
            times[index].append(time.perf_counter() - began)
    return [statistics.median(t) for t in times]
