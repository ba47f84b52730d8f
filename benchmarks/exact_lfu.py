"""The exact-count LFU: an online reference with perfect memory (Table 1, the sweep).

LFU over the exact request count of every item since the trace began: no sketch,
no aging, no window. A missed item is saved when the pool has room, or when the
least counted entries that make its room were all asked for fewer times than it
(its count includes this request); least recent first among equals. It shows how
near the oracle counting alone comes on a trace. Light on imports, so the sweep's
worker processes can run it.
"""

from __future__ import annotations

import heapq
import math

from ec_scheduler.sizing_references import BlockTrace, Result

__all__ = ["run_exact_lfu"]


def run_exact_lfu(trace: BlockTrace, capacity: int) -> Result:
    """Replay `trace` through the exact-count LFU (see the module) of `capacity` blocks."""
    count: dict[str, int] = {}
    held: dict[str, tuple[int, int]] = {}
    """Each held key's (count, time) as last pushed; heap items that differ are stale."""
    heap: list[tuple[int, int, str]] = []
    used = hit = requested = written = hits = 0
    sizes = trace.sizes
    for now, key in enumerate(trace.keys):
        rows = sizes[key]
        requested += rows
        count[key] = count.get(key, 0) + 1
        if key in held:
            hit += rows
            hits += 1
        elif rows > capacity:
            continue
        else:
            victims: list[tuple[int, int, str]] = []
            room = capacity - used
            while room < rows and heap:
                item = heapq.heappop(heap)
                if held.get(item[2]) != item[:2]:
                    continue  # stale: the key was hit or evicted since
                if item[0] >= count[key]:
                    heapq.heappush(heap, item)
                    break  # asked for as often as the candidate: it stays
                victims.append(item)
                room += sizes[item[2]]
            if room < rows:  # refused: the popped victims stay
                for item in victims:
                    heapq.heappush(heap, item)
                continue
            for _, _, victim in victims:
                del held[victim]
                used -= sizes[victim]
            used += rows
            written += rows
        held[key] = (count[key], now)
        heapq.heappush(heap, (count[key], now, key))
    return Result(
        hit / requested if requested else 0.0,
        written / hit if hit else math.inf,
        requests=len(trace.keys),
        hits=hits,
    )
