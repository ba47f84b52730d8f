"""Replays of a request trace through the tier's cache and through the references.

Used by the sizing tool (`ec_scheduler.sizing`) and the hit-ratio benchmark
(`benchmarks/hit_ratio.py`), so that both compute every figure with the same
code. Runs anywhere: the tier's cache here is the real `BlockAllocator` with a
real policy, and nothing is imported from vLLM.

A trace is a sequence of item keys in request order, and each key's size in
region blocks (`BlockTrace`). Every replay counts, over the requests:

* the byte hit ratio: blocks served from the cache / blocks requested (a block
  is a fixed number of bytes, so this is the ratio of bytes);
* `hits`: the requests served from the cache, that is the encoder runs saved;
* written per hit: blocks written to the cache per block served.

The caches:

* `run_ours`: `TierCache`, the allocator and policy as the scheduler drives
  them (admission, eviction, contiguous allocation);
* `run_plain_lru`: an ideal byte-capacity LRU without blocks (no fragmentation);
* `run_belady`: evicts the entry reused furthest in the future and never admits
  an entry that has no future use. With items of different sizes this is not the
  optimum of the byte hit ratio (it may evict a large entry for a small one
  reused sooner), so it is a reference, not an upper bound;
* `run_oracle`: the true-popularity oracle, a static cache holding, from each
  item's first request on, the items with the most requests in the whole
  trace, packed greedily by that count until the capacity is full. It misses
  every item's first request, as any cache must; it knows popularity but not
  order.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ec_core.policy_names import DEFAULT_POLICY
from ec_core.scheduler_process.allocator import BlockAllocator
from ec_core.scheduler_process.policy import make_policy

__all__ = [
    "BlockCache",
    "BlockTrace",
    "Result",
    "TierCache",
    "count_runs",
    "run_belady",
    "run_cache",
    "run_oracle",
    "run_ours",
    "run_plain_lru",
]


class BlockTrace(Protocol):
    """Item keys in request order, and each key's size in blocks (every key has one)."""

    @property
    def keys(self) -> Sequence[str]: ...

    @property
    def sizes(self) -> Mapping[str, int]: ...


class BlockCache(Protocol):
    """A block cache driven the way the scheduler drives the tier."""

    def request(self, key: str) -> bool | None:
        """True on a hit (pinned and released), False when absent, None when not ready."""

    def save(self, key: str, blocks: int) -> list[int] | None:
        """Allocate and mark ready; the entry's block ids, or None when refused."""


@dataclass
class Result:
    """What one replay measured (see the module)."""

    hit_ratio: float
    """Blocks served / blocks requested."""
    written_per_hit: float
    """Blocks written per block served (infinite without a hit)."""
    runs_per_entry: float = 1.0
    """Runs of consecutive blocks per saved entry (copy descriptors); 1 where not measured."""
    requests: int = 0
    """Requests replayed."""
    hits: int = 0
    """Requests served from the cache: the encoder runs saved."""


def _result(
    hit: int,
    requested: int,
    written: int,
    hits: int,
    requests: int,
    *,
    runs: list[int] | None = None,
) -> Result:
    return Result(
        hit / requested if requested else 0.0,
        written / hit if hit else math.inf,
        sum(runs) / len(runs) if runs else 1.0,
        requests,
        hits,
    )


class TierCache:
    """The tier's `BlockAllocator` with a policy, as the scheduler drives it: a lookup
    tells the policy (`note_request`) and pins and releases a ready entry; a miss
    that is saved is allocated, then marked ready once written."""

    def __init__(self, capacity: int, policy: str = DEFAULT_POLICY) -> None:
        """`capacity`: the region's blocks; `policy`: a name of `ec_core.policy_names`."""
        self.alloc = BlockAllocator(capacity, make_policy(policy, capacity))

    def request(self, key: str) -> bool | None:
        """True on a hit, False when absent, None when present but not ready."""
        self.alloc.note_request(key)
        entry = self.alloc.get(key)
        if entry is None:
            return False
        if not entry.ready:
            return None
        self.alloc.pin(key)
        self.alloc.unpin(key)
        return True

    def save(self, key: str, blocks: int) -> list[int] | None:
        """Allocate, mark ready, and build the block-id list a save's metadata carries
        (what the scheduler does for a save); the ids, or None when refused."""
        entry = self.alloc.alloc(key, blocks)
        if entry is None:
            return None
        self.alloc.mark_ready(key)
        return self.alloc.block_ids(entry)


def count_runs(ids: list[int]) -> int:
    """Runs of consecutive block ids: the copy descriptors an entry needs."""
    return 1 + sum(1 for a, b in itertools.pairwise(ids) if b != a + 1) if ids else 0


def run_cache(trace: BlockTrace, cache: BlockCache) -> Result:
    """Replay `trace` against a block cache: hits pin/unpin, misses are saved."""
    hit = requested = written = hits = 0
    runs: list[int] = []
    sizes = trace.sizes
    for key in trace.keys:
        rows = sizes[key]
        requested += rows
        found = cache.request(key)
        if found:
            hit += rows
            hits += 1
        elif found is False:
            saved = cache.save(key, rows)
            if saved is not None:
                runs.append(count_runs(saved))
                written += rows
    return _result(hit, requested, written, hits, len(trace.keys), runs=runs)


def run_ours(trace: BlockTrace, capacity: int, policy: str = DEFAULT_POLICY) -> Result:
    """Replay through the tier's allocator and `policy` with `capacity` blocks."""
    return run_cache(trace, TierCache(capacity, policy))


def run_plain_lru(trace: BlockTrace, capacity: int) -> Result:
    """Replay through an ideal LRU of `capacity` blocks (no fragmentation)."""
    cached: OrderedDict[str, int] = OrderedDict()
    used = hit = requested = written = hits = 0
    sizes = trace.sizes
    for key in trace.keys:
        rows = sizes[key]
        requested += rows
        if key in cached:
            hit += rows
            hits += 1
            cached.move_to_end(key)
            continue
        if rows > capacity:
            continue
        while used + rows > capacity:
            _, freed = cached.popitem(last=False)
            used -= freed
        cached[key] = rows
        used += rows
        written += rows
    return _result(hit, requested, written, hits, len(trace.keys))


def run_belady(trace: BlockTrace, capacity: int) -> Result:
    """Replay through Belady's furthest-next-use eviction with `capacity` blocks."""
    keys = trace.keys
    sizes = trace.sizes
    next_use = [math.inf] * len(keys)
    seen: dict[str, int] = {}
    for index in range(len(keys) - 1, -1, -1):
        next_use[index] = seen.get(keys[index], math.inf)
        seen[keys[index]] = index
    cached: dict[str, float] = {}
    furthest: list[tuple[float, str]] = []  # max-heap by next use (negated)
    used = hit = requested = written = hits = 0
    for index, key in enumerate(keys):
        rows = sizes[key]
        requested += rows
        upcoming = next_use[index]
        if key in cached:
            hit += rows
            hits += 1
            cached[key] = upcoming
            heapq.heappush(furthest, (-upcoming, key))
            continue
        if upcoming == math.inf or rows > capacity:
            continue  # never admit an item with no future use
        cached[key] = upcoming
        heapq.heappush(furthest, (-upcoming, key))
        used += rows
        while used > capacity:  # evict furthest-reused first (possibly the newcomer)
            negated, victim = heapq.heappop(furthest)
            if cached.get(victim) != -negated:
                continue  # stale heap record
            del cached[victim]
            used -= sizes[victim]
        if key in cached:
            written += rows
    return _result(hit, requested, written, hits, len(keys))


def run_oracle(trace: BlockTrace, capacity: int) -> Result:
    """Replay through the true-popularity oracle with `capacity` blocks."""
    sizes = trace.sizes
    counts = Counter(trace.keys)
    held: set[str] = set()
    used = 0
    for key, _ in counts.most_common():
        rows = sizes[key]
        if used + rows <= capacity:
            held.add(key)
            used += rows
    hit = requested = written = hits = 0
    seen: set[str] = set()
    for key in trace.keys:
        rows = sizes[key]
        requested += rows
        if key in seen:
            if key in held:
                hit += rows
                hits += 1
            continue
        seen.add(key)
        written += rows if key in held else 0
    return _result(hit, requested, written, hits, len(trace.keys))
