"""Eviction and admission policies: which entries leave the region first.

The allocator owns the entries and their states; a policy only orders the
entries the allocator tells it are evictable (ready and unpinned), says which
missed items deserve a save, and names victims. The allocator never evicts a
key a policy names unless it is evictable, so no policy can break the pin and
readiness rules.

Every method is O(log n) in the number of entries (amortised where noted).
"""

from __future__ import annotations

import itertools
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sortedcontainers import SortedList


@runtime_checkable
class EvictionPolicy(Protocol):
    """The events an allocator reports, and the questions it asks."""

    name: str

    def on_request(self, key: str) -> None:
        """Someone asked for `key` (a lookup, hit or miss)."""

    def admit(self, key: str, num_blocks: int) -> bool:
        """Whether a missed item of `num_blocks` should be saved at all."""

    def on_insert(self, key: str, num_blocks: int) -> None:
        """A new, not yet ready entry was allocated for `key`."""

    def on_evictable(self, key: str, num_blocks: int) -> None:
        """`key` became evictable: its save finished, or its last pin went."""

    def on_held(self, key: str) -> None:
        """`key` was pinned for a load (a hit); it is not evictable until released."""

    def on_removed(self, key: str) -> None:
        """`key` left the pool (evicted, discarded or dropped)."""

    def candidates(self) -> Iterator[str]:
        """Evictable keys, the policy's preferred victims first (lazy).

        The allocator weighs address-adjacent victims by their position in
        this order when it evicts a window to keep a new entry in one run.
        """


class LRUPolicy:
    """Least recently used first; every missed item is admitted.

    An entry's recency is the last time it became evictable: when its save
    finished, or when the last load that pinned it completed. Close to vLLM's
    in-tree behaviour (FIFO refreshed on reload).
    """

    name = "lru"

    def __init__(self, num_blocks: int = 0) -> None:
        """`num_blocks` is accepted for a uniform constructor and not needed."""
        self._order: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def on_request(self, key: str) -> None:
        return None

    def admit(self, key: str, num_blocks: int) -> bool:
        return True

    def on_insert(self, key: str, num_blocks: int) -> None:
        return None

    def on_evictable(self, key: str, num_blocks: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_held(self, key: str) -> None:
        self._order.pop(key, None)

    def on_removed(self, key: str) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[str]:
        return iter(self._order)


class _History:
    """Decaying request counts per key (how popular an item has been lately).

    When more than `limit` keys are tracked, every count is halved and keys
    that reach zero are forgotten: memory stays bounded and old popularity
    fades. Amortised O(1): a halving pass over m keys happens at most once per
    m/2 new keys.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 64)
        self.counts: dict[str, int] = {}

    def touch(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
        if len(self.counts) > self.limit:
            self.counts = {k: c >> 1 for k, c in self.counts.items() if c > 1}

    def get(self, key: str) -> int:
        return self.counts.get(key, 0)


class _FirstSightingGate:
    """The doorkeeper of the adaptive policies: whether an item seen for the first
    time is worth writing.

    First sightings are written while they have been paying off (a moving
    average of "hit before it left" at or above `admit_threshold`); otherwise one
    in `probe_every` is still written, so the average keeps being measured. A
    written first sighting is on trial until it is hit or leaves.
    """

    first_sighting_payoff: float
    admit_threshold: float
    probe_every: int
    ema_weight: float
    _first_sightings: int
    _trial: set[str]

    def _let_first_sighting_in(self, key: str) -> bool:
        self._first_sightings += 1
        if (
            self.first_sighting_payoff >= self.admit_threshold
            or self._first_sightings % self.probe_every == 0
        ):
            self._trial.add(key)
            return True
        return False

    def _trial_outcome(self, key: str, paid_off: bool) -> None:
        if key in self._trial:
            self._trial.discard(key)
            self._payoff(paid_off)

    def _payoff(self, paid_off: bool) -> None:
        target = 1.0 if paid_off else 0.0
        self.first_sighting_payoff += self.ema_weight * (target - self.first_sighting_payoff)


class S3LFUPolicy(_FirstSightingGate):
    """Adaptive admission and a probation queue in front of LFU with aging.

    * **Probation.** A saved item first enters probation (`small`, FIFO),
      unless it is one of the last `ghost_entries` items that left probation
      without a hit (the **ghost** list): then it goes straight to main — it
      came back right after being dropped. A hit on a probationary entry
      promotes it to main. Victims come from probation, oldest first, while it
      holds more than `small_fraction` of the pool; otherwise from main. (A
      short ghost list measured best: a long one lets lukewarm items displace
      main entries on Zipf traffic.)
    * **Main** evicts by LFU with dynamic aging: priority = L + recent request
      count, where L is the priority of the last main entry evicted, so entries
      popular long ago age out and recurring ones stay.
    * **Adaptive admission.** An item seen before (or in the ghost list) is
      always saved. A first sighting is saved while first sightings have been
      paying off: the policy tracks, as a moving average, how often an entry
      saved at its first sighting was hit before leaving probation. When that
      falls below `admit_threshold` (a workload full of one-off images) only
      one first sighting in `probe_every` is saved — enough to notice when the
      workload changes — and the rest are never written, so they cannot push
      anything out. When first sightings recur (chat turns re-send recent
      images), they are all saved.

    It is S3-FIFO's structure (probation + ghost) with an LFU-DA main part and
    a TinyLFU-like doorkeeper that switches itself on and off.
    """

    name = "s3lfu"

    def __init__(
        self,
        num_blocks: int = 0,
        *,
        small_fraction: float = 0.20,
        ghost_entries: int = 16,
        admit_threshold: float = 0.25,
        probe_every: int = 10,
        ema_weight: float = 0.02,
    ) -> None:
        self.small_target = max(int(num_blocks * small_fraction), 1)
        self.ghost_entries = ghost_entries
        self.admit_threshold = admit_threshold
        self.probe_every = probe_every
        self.ema_weight = ema_weight
        self.first_sighting_payoff = 1.0
        """Moving average of "a first-sighting save was hit while on probation"."""
        self._blocks: dict[str, int] = {}
        self._in_small: set[str] = set()
        self._small_blocks = 0
        self._small: OrderedDict[str, None] = OrderedDict()  # evictable probationary keys
        # Imported here: worker processes import this module for the policy
        # names only (settings), and need no sortedcontainers.
        from sortedcontainers import SortedList

        self._main: SortedList = SortedList()  # (priority, seq, key) of evictable main keys
        self._main_key: dict[str, tuple[float, int]] = {}
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._trial: set[str] = set()  # saved at first sighting, outcome pending
        self._first_sightings = 0
        self._aging = 0.0
        self._seq = itertools.count()
        self._history = _History(limit=1 << 16)

    # ----------------------------------------------------------- events

    def on_request(self, key: str) -> None:
        self._history.touch(key)
        # History must outlive the entries it ranks.
        self._history.limit = max(self._history.limit, 8 * len(self._blocks))

    def admit(self, key: str, num_blocks: int) -> bool:
        if self._history.get(key) >= 2 or key in self._ghost:
            return True
        return self._let_first_sighting_in(key)

    def on_insert(self, key: str, num_blocks: int) -> None:
        self._blocks[key] = num_blocks
        if key in self._ghost:
            del self._ghost[key]  # it recurred soon after leaving probation: main
        else:
            self._in_small.add(key)
            self._small_blocks += num_blocks

    def on_evictable(self, key: str, num_blocks: int) -> None:
        if key in self._in_small:
            self._small[key] = None
        else:
            entry = (self._aging + self._history.get(key), next(self._seq))
            self._main_key[key] = entry
            self._main.add((*entry, key))

    def on_held(self, key: str) -> None:
        self._small.pop(key, None)
        entry = self._main_key.pop(key, None)
        if entry is not None:
            self._main.remove((*entry, key))
        if key in self._in_small:  # a hit on probation: promote
            self._trial_outcome(key, paid_off=True)
            self._in_small.discard(key)
            self._small_blocks -= self._blocks.get(key, 0)

    def on_removed(self, key: str) -> None:
        blocks = self._blocks.pop(key, 0)
        self._trial_outcome(key, paid_off=False)
        self._small.pop(key, None)
        entry = self._main_key.pop(key, None)
        if entry is not None:
            self._main.remove((*entry, key))
            self._aging = max(self._aging, entry[0])
        if key in self._in_small:
            self._in_small.discard(key)
            self._small_blocks -= blocks
            self._ghost[key] = None
            while len(self._ghost) > self.ghost_entries:
                self._ghost.popitem(last=False)

    # ---------------------------------------------------------- queries

    def candidates(self) -> Iterator[str]:
        main = (key for _, _, key in self._main)
        if self._small_blocks > self.small_target or not self._main:
            yield from self._small
            yield from main
        else:
            yield from main
            yield from self._small


_HALVE = bytes(value >> 1 for value in range(256))
"""`bytearray.translate` table that halves every counter (the sketch's aging)."""

_MIX = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_MASK64 = (1 << 64) - 1


class FrequencySketch:
    """Approximate, aging request counts in a fixed number of small counters.

    A count-min sketch: `depth` rows of `width` counters (one byte each,
    saturating at `cap`), a key's estimate is the least of its `depth`
    counters, and an increment raises only the counters equal to that least
    value (conservative update). After every `period` increments all counters
    are halved, so popularity fades and counts stay comparable over time.

    Guarantees: memory is exactly `depth * width` bytes, whatever the number of
    distinct keys seen (`width` only ever changes through `resize`, which never
    exceeds `max_width`); an estimate never undercounts a key's increments
    since the last reset, halving aside; every operation is O(depth), halving
    O(width) once per `period` increments (amortised O(1) for `period >= width`).
    Keys are hashed with CRC-32, not `hash()`, so estimates are the same in every
    process (deterministic benchmarks and replays).
    """

    depth = 4
    """Rows of counters (fixed: `_slots` is unrolled for four)."""

    def __init__(
        self, width: int, *, max_width: int = 1 << 20, cap: int = 15, period_factor: float = 10.0
    ) -> None:
        self.max_width = max(_pow2_at_least(max_width), 16)
        self.cap = cap
        self.period_factor = period_factor
        self.width = 0
        self.counters = bytearray()
        self.period = 0
        self.increments = 0
        self.resets = 0
        self.resize(width)

    def resize(self, width: int) -> None:
        """Start over with `width` counters a row (a power of two, at most `max_width`)."""
        width = min(max(_pow2_at_least(width), 16), self.max_width)
        if width == self.width:
            return
        self.width = width
        self._shift = 64 - (width.bit_length() - 1)
        self.counters = bytearray(self.depth * width)
        self.period = max(int(self.period_factor * width), 1)
        self.increments = 0

    def _slots(self, key: str) -> tuple[int, int, int, int]:
        """The key's counter in each of the four rows (unrolled: this runs on every lookup)."""
        data = key.encode()
        digest = (zlib.crc32(data) << 32) | zlib.crc32(data, 0x5BD1E995)
        shift, width = self._shift, self.width
        m0, m1, m2, m3 = _MIX
        return (
            ((digest * m0) & _MASK64) >> shift,
            width + (((digest * m1) & _MASK64) >> shift),
            2 * width + (((digest * m2) & _MASK64) >> shift),
            3 * width + (((digest * m3) & _MASK64) >> shift),
        )

    def estimate(self, key: str) -> int:
        """The key's approximate recent request count (0 to `cap`)."""
        counters = self.counters
        a, b, c, d = self._slots(key)
        return min(counters[a], counters[b], counters[c], counters[d])

    def increment(self, key: str) -> None:
        """Count one request for `key`; halves every counter once per `period`."""
        counters = self.counters
        a, b, c, d = self._slots(key)
        ca, cb, cc, cd = counters[a], counters[b], counters[c], counters[d]
        least = min(ca, cb, cc, cd)
        if least < self.cap:
            raised = least + 1
            if ca == least:
                counters[a] = raised
            if cb == least:
                counters[b] = raised
            if cc == least:
                counters[c] = raised
            if cd == least:
                counters[d] = raised
        self.increments += 1
        if self.increments >= self.period:
            self.counters = counters.translate(_HALVE)
            self.increments = 0
            self.resets += 1


def _pow2_at_least(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


_WINDOW, _PROBATION, _PROTECTED, _OUTGOING = range(4)


class WTinyLFUPolicy(_FirstSightingGate):
    """Adaptive W-TinyLFU, weighted by size: an LRU window in front of a
    frequency-filtered segmented LRU, with the window's share tuned online.

    * **Segments.** Every entry belongs to one of: the **window** (LRU, where
      every saved item starts), **probation** and **protected** (the main
      part, a segmented LRU: a hit on probation promotes to protected; when
      protected outgrows `protected_fraction` of the main part, its least
      recent entries drop back to probation), or **outgoing** (items that lost
      their admission duel; they go first). Budgets are in blocks, so a
      200 MB entry weighs what it occupies.
    * **Admission duel (TinyLFU).** When the window outgrows its share, its
      least recent entry (the candidate) asks to enter the main part. While
      the pool has room for it, it enters probation. Otherwise it is compared
      with the *set* of main entries it would displace (least recent
      probation first, then protected) covering its size: it is admitted when
      its estimated request frequency exceeds their block-weighted mean (for
      a byte hit ratio a block is worth its entry's request rate, whatever the
      entry's size); a loser moves to outgoing. A loser requested again before
      it leaves goes back to the window.
    * **Victim order** (`candidates`): outgoing, probation, window, protected,
      each least recent first.
    * **Window sizing (climbing on ghost hits).** Caffeine climbs the window
      size by sampling the hit rate; here each step's direction comes from
      the marginal value of the two sides, measured per request: the policy
      remembers (keys and sizes only, about one pool's worth each) the
      entries that left from the window or outgoing, and those that left from
      the main part. A request for a key of the first kind is a hit a larger
      window would have had: the window's share grows by that entry's blocks
      (more when that ghost list is the shorter, as in ARC); one of the second
      kind shrinks it. A window of the whole pool makes the policy LRU, so it
      retreats to LRU on recency-heavy traffic (chat: re-sent images lose
      duels, come back, and grow the window) and to a tiny window on
      frequency-heavy traffic, without waiting for noisy samples.
    * **LRU guard.** A shadow plain LRU of the same capacity (keys and sizes
      only) sees the same requests. After each sample of `lru_guard_sample`
      pools' worth of requested blocks, if it served more blocks than the
      policy did (by more than `lru_guard_margin` of the sample), the window
      grows by `lru_guard_step` of the pool at once: a paired comparison on
      the same requests, so the workload's own drift does not mislead it,
      and the fast way back to LRU when recency takes over (a phase change,
      many live chat sessions).
    * **Doorkeeper.** A first sighting (sketch estimate 1) is saved while
      first-sighting saves have been paying off: a moving average of "hit
      before it left the pool". When that falls below
      `admit_threshold` (a stream of one-off images) only one first sighting
      in `probe_every` is written, so one-offs cost no copy and push nothing
      out. Items seen before are always saved.
    * **Sketch.** A `FrequencySketch`, `16 x` the entry count wide (grown as
      the pool holds more entries, never past `max_sketch_width` counters a
      row), halved every `sketch_period_factor` widths of requests (about ten
      requests per entry, as in Caffeine).

    Every event is O(1) amortised, except a duel, which walks at most
    `max_duel_victims` of the victims a candidate would displace. Memory:
    the sketch's fixed bytes, plus per-key state for the pool's entries and
    three ghost lists of at most `capacity` blocks and `max_ghost_entries`
    keys each (the shadow LRU holds at most `capacity` blocks).
    """

    name = "wtinylfu"

    def __init__(
        self,
        num_blocks: int = 0,
        *,
        window_fraction: float = 0.01,
        min_window_fraction: float = 0.01,
        protected_fraction: float = 0.80,
        admit_threshold: float = 0.25,
        probe_every: int = 25,
        ema_weight: float = 0.02,
        max_sketch_width: int = 1 << 20,
        max_duel_victims: int = 8,
        max_ghost_entries: int = 1 << 16,
        sketch_period_factor: float = 0.6,
        lru_guard_step: float = 0.25,
        lru_guard_sample: float = 1.0,
        lru_guard_margin: float = 0.0,
    ) -> None:
        self.lru_guard_step = lru_guard_step
        self.lru_guard_sample = lru_guard_sample
        self.lru_guard_margin = lru_guard_margin
        self.capacity = max(num_blocks, 1)
        self.min_window = self.capacity * min_window_fraction
        self.window_target = max(self.capacity * window_fraction, self.min_window)
        self.protected_fraction = protected_fraction
        self.admit_threshold = admit_threshold
        self.probe_every = probe_every
        self.ema_weight = ema_weight
        self.max_duel_victims = max_duel_victims
        self.max_ghost_entries = max_ghost_entries
        self.sketch = FrequencySketch(
            1024, max_width=max_sketch_width, period_factor=sketch_period_factor
        )
        # Invariant: every key the allocator holds is in `_segment` and
        # `_blocks`, in exactly one segment, and its blocks are counted in that
        # segment's `_bytes`; the evictable ones, and only those, are in their
        # segment's `_order` (least recent first).
        self._segment: dict[str, int] = {}
        self._blocks: dict[str, int] = {}
        self._bytes = [0, 0, 0, 0]
        self._order: tuple[OrderedDict[str, None], ...] = tuple(OrderedDict() for _ in range(4))
        self._used = 0
        # Ghosts: keys that left, with their blocks; each list holds at most
        # `capacity` blocks and `max_ghost_entries` keys.
        self._ghosts = (
            _Ghosts(self.capacity, max_ghost_entries),
            _Ghosts(self.capacity, max_ghost_entries),
        )
        self.first_sighting_payoff = 1.0
        """Moving average of "a first-sighting save was hit before it left"."""
        # The LRU guard: a shadow plain LRU (keys and sizes only, at most
        # `capacity` blocks) fed the same requests; per sample of one pool's
        # worth of requested blocks, hit blocks of both.
        self._shadow: OrderedDict[str, int] = OrderedDict()
        self._shadow_used = 0
        self._sample = [0, 0, 0]  # requested, our hits, shadow hits
        self._trial: set[str] = set()
        self._refused = _Ghosts(self.capacity, max_ghost_entries)
        """First sightings not saved, kept to learn whether refusing them was right."""
        self._first_sightings = 0

    # ----------------------------------------------------------- events

    def on_request(self, key: str) -> None:
        self._feed_shadow(key)
        self.sketch.increment(key)
        if len(self._blocks) * 4 > self.sketch.width:
            self.sketch.resize(len(self._blocks) * 16)
        if self._refused.pop(key) is not None:
            self._payoff(True)  # a refused first sighting came back soon: saving it would pay
        recency, main = self._ghosts
        blocks = recency.pop(key)
        if blocks is not None:
            step = blocks * max(1.0, main.blocks / max(recency.blocks, 1))
            self.window_target = min(self.window_target + step, float(self.capacity))
            return
        blocks = main.pop(key)
        if blocks is not None:
            step = blocks * max(1.0, recency.blocks / max(main.blocks, 1))
            self.window_target = max(self.window_target - step, self.min_window)
            self._rebalance()

    def admit(self, key: str, num_blocks: int) -> bool:
        if self.sketch.estimate(key) >= 2 or key in self._ghosts[0] or key in self._ghosts[1]:
            return True
        if self._let_first_sighting_in(key):
            return True
        for _ in self._refused.add(key, num_blocks):
            self._payoff(False)  # forgotten without coming back: refusing it was right
        return False

    def on_insert(self, key: str, num_blocks: int) -> None:
        self._segment[key] = _WINDOW
        self._blocks[key] = num_blocks
        self._bytes[_WINDOW] += num_blocks
        self._used += num_blocks
        self._sample[0] += num_blocks  # a save follows a miss
        if key not in self._shadow:
            self._shadow_insert(key, num_blocks)
        self._rebalance()

    def on_evictable(self, key: str, num_blocks: int) -> None:
        segment = self._segment.get(key)
        if segment is None:  # the allocator did not announce it: adopt it
            self.on_insert(key, num_blocks)
            segment = _WINDOW
        self._order[segment][key] = None
        self._rebalance()

    def on_held(self, key: str) -> None:
        segment = self._segment.get(key)
        if segment is None:
            return
        self._order[segment].pop(key, None)
        self._trial_outcome(key, paid_off=True)
        blocks = self._blocks[key]
        self._sample[0] += blocks
        self._sample[1] += blocks
        self._end_sample_if_due()
        if segment == _PROBATION:
            self._move(key, _PROTECTED)
            self._demote_protected()
        elif segment == _OUTGOING:
            self._move(key, _WINDOW)  # it was worth keeping after all

    def on_removed(self, key: str) -> None:
        segment = self._segment.pop(key, None)
        if segment is None:
            return
        blocks = self._blocks.pop(key)
        self._bytes[segment] -= blocks
        self._used -= blocks
        self._order[segment].pop(key, None)
        self._trial_outcome(key, paid_off=False)
        self._ghosts[segment in (_PROBATION, _PROTECTED)].add(key, blocks)

    # ---------------------------------------------------------- queries

    def candidates(self) -> Iterator[str]:
        for segment in (_OUTGOING, _PROBATION, _WINDOW, _PROTECTED):
            yield from self._order[segment]

    @property
    def window_share(self) -> float:
        """The window's current target, as a fraction of the pool."""
        return self.window_target / self.capacity

    def segment_blocks(self) -> dict[str, int]:
        """Blocks per segment (window, probation, protected, outgoing)."""
        names = ("window", "probation", "protected", "outgoing")
        return dict(zip(names, self._bytes, strict=True))

    def tracked_keys(self) -> set[str]:
        """Every key the policy keeps state for (entries, ghosts, trials, shadow)."""
        ghosts = self._ghosts[0].keys() | self._ghosts[1].keys() | self._refused.keys()
        return set(self._segment) | ghosts | self._trial | set(self._shadow)

    # -------------------------------------------------------- LRU guard

    def _feed_shadow(self, key: str) -> None:
        blocks = self._shadow.get(key)
        if blocks is not None:
            self._shadow.move_to_end(key)
            self._sample[2] += blocks
        else:
            blocks = self._blocks.get(key)  # a miss's size is known once it is saved
            if blocks is not None:
                self._shadow_insert(key, blocks)

    def _shadow_insert(self, key: str, blocks: int) -> None:
        if not 0 < blocks <= self.capacity:
            return  # zero-block entries weigh nothing; so the shadow holds <= capacity keys
        self._shadow[key] = blocks
        self._shadow_used += blocks
        while self._shadow_used > self.capacity:
            _, gone = self._shadow.popitem(last=False)
            self._shadow_used -= gone

    def _end_sample_if_due(self) -> None:
        """Once a pool's worth of blocks was requested: if plain LRU would have
        served more of them, grow the window by `lru_guard_step` of the pool."""
        requested, ours, shadow = self._sample
        if requested < self.lru_guard_sample * self.capacity:
            return
        self._sample = [0, 0, 0]
        if shadow > ours + self.lru_guard_margin * requested:
            step = self.lru_guard_step * self.capacity
            self.window_target = min(self.window_target + step, float(self.capacity))

    # -------------------------------------------------------- internals

    def _move(self, key: str, segment: int) -> None:
        old = self._segment[key]
        blocks = self._blocks[key]
        self._bytes[old] -= blocks
        self._bytes[segment] += blocks
        self._segment[key] = segment
        if self._order[old].pop(key, False) is None:
            self._order[segment][key] = None

    def _demote_protected(self) -> None:
        limit = (self.capacity - self.window_target) * self.protected_fraction
        order = self._order[_PROTECTED]
        while self._bytes[_PROTECTED] > limit and order:
            self._move(next(iter(order)), _PROBATION)

    def _rebalance(self) -> None:
        """Move the window's least recent entries out while it is over its share."""
        order = self._order[_WINDOW]
        while self._bytes[_WINDOW] > self.window_target and order:
            candidate = next(iter(order))
            self._move(candidate, _PROBATION if self._wins_duel(candidate) else _OUTGOING)
        self._demote_protected()

    def _wins_duel(self, candidate: str) -> bool:
        """Whether the candidate should displace the main entries it would push out."""
        size = self._blocks[candidate]
        if self.capacity - self._used >= size:
            return True  # the pool still has room for another item like it
        weighted = covered = seen = 0
        for segment in (_PROBATION, _PROTECTED):
            for victim in self._order[segment]:
                blocks = self._blocks[victim]
                weighted += self.sketch.estimate(victim) * blocks
                covered += blocks
                seen += 1
                if covered >= size or seen >= self.max_duel_victims:
                    break
            if covered >= size or seen >= self.max_duel_victims:
                break
        if covered == 0:
            return True  # nothing in main to protect
        return self.sketch.estimate(candidate) * covered > weighted


class _Ghosts:
    """Keys that recently left, with their sizes: at most `max_blocks` blocks
    and `max_entries` keys (oldest forgotten first). O(1) per operation."""

    def __init__(self, max_blocks: int, max_entries: int) -> None:
        self.max_blocks = max_blocks
        self.max_entries = max_entries
        self.blocks = 0
        self._keys: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> set[str]:
        return set(self._keys)

    def add(self, key: str, blocks: int) -> list[str]:
        """Remember `key`; the keys forgotten to make room for it, oldest first."""
        self.pop(key)
        self._keys[key] = blocks
        self.blocks += blocks
        forgotten: list[str] = []
        while self._keys and (self.blocks > self.max_blocks or len(self._keys) > self.max_entries):
            old, gone = self._keys.popitem(last=False)
            self.blocks -= gone
            forgotten.append(old)
        return forgotten

    def pop(self, key: str) -> int | None:
        blocks = self._keys.pop(key, None)
        if blocks is not None:
            self.blocks -= blocks
        return blocks


POLICIES: dict[str, type[LRUPolicy] | type[S3LFUPolicy] | type[WTinyLFUPolicy]] = {
    policy.name: policy for policy in (WTinyLFUPolicy, S3LFUPolicy, LRUPolicy)
}
"""Policies by the name users give in the config (`ec_eviction_policy`); each
is built as `POLICIES[name](num_blocks)`."""

DEFAULT_POLICY = WTinyLFUPolicy.name


def make_policy(name: str, num_blocks: int = 0) -> EvictionPolicy:
    """A fresh policy object for a configured policy name and pool size."""
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}")
    return policy(num_blocks)
