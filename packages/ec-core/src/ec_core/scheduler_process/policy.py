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

    @property
    def strict_order(self) -> bool:
        """Whether the allocator must evict in exactly this policy's order now.

        True: the order carries the policy's information (recency), so a new
        entry never costs an entry the order ranks later than the victims it
        names, even if that splits the new entry over several runs. False: the
        allocator may evict a window of address-adjacent entries, weighed by
        their rank in the order, to keep the new entry in one run.
        """

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
    strict_order = True
    """Recency is all LRU knows: it is evicted in exactly that order."""

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
    strict_order = False
    """LFU priorities are coarse: a cheaper window near the first victims is as good."""

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

_SPREAD = 0x9E3779B97F4A7C15F39CC0605CEDC835
"""Odd 128-bit multiplier: row r's index is the top bits of bits [32r, 32r + 32)
of `hash * _SPREAD` (a multiplicative hash modulo 2**(32r + 32) per row)."""


def key_hash(key: str) -> int:
    """CRC-32 of the key's UTF-8 bytes: the same in every process, unlike `hash()`."""
    return zlib.crc32(key.encode())


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
    since the last halving (a `resize` keeps every count); every operation is
    O(depth) with one CRC-32 of the key (none for the `*_hash` forms, given
    `key_hash(key)`), halving O(width) once per `period` increments (amortised
    O(1) for `period >= width`). Keys are hashed with CRC-32, not `hash()`, so
    estimates are the same in every process (deterministic benchmarks and
    replays).
    """

    depth = 4
    """Rows of counters (fixed: the index arithmetic is unrolled for four)."""

    def __init__(
        self, width: int, *, max_width: int = 1 << 20, cap: int = 15, period_factor: float = 10.0
    ) -> None:
        self.max_width = min(max(_pow2_at_least(max_width), 16), 1 << 32)
        self.cap = cap
        self.period_factor = period_factor
        self.width = 0
        self.counters = bytearray(self.depth * 16)
        self.period = 1
        self.increments = 0
        self.resets = 0
        self._mask = 15
        self._shifts = (0, 0, 0, 0)
        self.resize(width)

    def resize(self, width: int) -> None:
        """Use `width` counters a row (a power of two, 16 to `max_width`), keeping the counts.

        Row r's index of a key is the top log2(width) bits of a fixed 32-bit
        field of its hash, so when the width grows by 2**k a key's new index
        `i` satisfies `i >> k == old index`: each old counter is copied to the
        2**k counters that replace it. When it shrinks, merged counters keep
        the largest count. Either way no key's estimate drops. O(new width).
        """
        width = min(max(_pow2_at_least(width), 16), self.max_width)
        if width == self.width:
            return
        counters = self.counters
        old = max(self.width, 16)
        while old < width:  # each byte twice: row r of the old array becomes row r of the new
            doubled = bytearray(2 * len(counters))
            doubled[0::2] = counters
            doubled[1::2] = counters
            counters, old = doubled, old * 2
        while old > width:
            counters, old = bytearray(map(max, counters[0::2], counters[1::2])), old // 2
        self.counters = counters
        self.width = width
        self._mask = width - 1
        bits = width.bit_length() - 1
        self._shifts = (32 - bits, 64 - bits, 96 - bits, 128 - bits)
        self.period = max(int(self.period_factor * width), 1)

    def estimate(self, key: str) -> int:
        """The key's approximate recent request count (0 to `cap`)."""
        return self.estimate_hash(zlib.crc32(key.encode()))

    def estimate_hash(self, digest: int) -> int:
        """`estimate` of the key whose `key_hash` is `digest`."""
        spread = digest * _SPREAD
        counters, mask, width = self.counters, self._mask, self.width
        s0, s1, s2, s3 = self._shifts
        return min(
            counters[(spread >> s0) & mask],
            counters[width + ((spread >> s1) & mask)],
            counters[2 * width + ((spread >> s2) & mask)],
            counters[3 * width + ((spread >> s3) & mask)],
        )

    def increment(self, key: str) -> None:
        """Count one request for `key`; halves every counter once per `period`."""
        self.increment_hash(zlib.crc32(key.encode()))

    def increment_hash(self, digest: int) -> None:
        """`increment` of the key whose `key_hash` is `digest`."""
        spread = digest * _SPREAD
        counters, mask, width = self.counters, self._mask, self.width
        s0, s1, s2, s3 = self._shifts
        a = (spread >> s0) & mask
        b = width + ((spread >> s1) & mask)
        c = 2 * width + ((spread >> s2) & mask)
        d = 3 * width + ((spread >> s3) & mask)
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
    frequency-filtered segmented LRU, with the window's share tuned online,
    and a recency mode it falls back to while plain LRU would do better.

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
    * **Window sizing (climbing on ghost hits).** The policy remembers (keys
      and sizes only, about one pool's worth each) the entries that left from
      the window or outgoing, and those that left from the main part. A
      request for a key of the first kind is a hit a larger window would have
      had: the window's share grows by that entry's blocks (more when that
      ghost list is the shorter, as in ARC); one of the second kind shrinks
      it, down to `min_window_fraction`.
    * **Recency mode (the LRU guard).** Two shadow caches of the pool's
      capacity (keys and sizes only, no blocks, so no fragmentation) see the
      same requests: a plain LRU, and a W-TinyLFU with a fixed
      `shadow_window_fraction` window and an LRU main part (the frequency
      expert). After each sample of `guard_sample` pools' worth of requested
      blocks, the policy takes the side of the shadow that served more of
      them (by more than `guard_margin` of the sample, else it stays): when
      LRU won it enters **recency mode** — the window is the whole pool, every
      hit moves its entry to the window's most recent end, no duels happen,
      so the victim order becomes LRU's as the old main entries age out, and
      the allocator keeps that order exactly (`strict_order`), splitting a
      new entry rather than evicting out of order;
      when the frequency expert won it leaves it, with the window back at
      its initial share. A paired comparison on the same requests, so the
      workload's own drift does not mislead it; it costs two dictionary
      operations per request.
    * **Doorkeeper.** A first sighting (sketch estimate 1) is saved while
      first-sighting saves have been paying off: a moving average of "hit
      before it left the pool". When that falls below
      `admit_threshold` (a stream of one-off images) only one first sighting
      in `probe_every` is written, so one-offs cost no copy and push nothing
      out. Items seen before are always saved. It acts in both modes.
    * **Sketch.** A `FrequencySketch`, `16 x` the entry count wide (grown as
      the pool holds more entries, never past `max_sketch_width` counters a
      row), halved every `sketch_period_factor` widths of requests. A key is
      hashed once per request (the hash is remembered for the admission
      that follows a miss).

    Every event is O(1) amortised, except a duel, which walks at most
    `max_duel_victims` of the victims a candidate would displace (the
    frequency expert's duel at most `shadow_duel_victims`: 32 left Table 1 as
    it was with no bound, 8 moved its Zipf rows by up to 1.5 %), and a mode
    change, which moves every entry once (at most once per sample, so O(1)
    amortised over the sample's requests). Memory: the sketch's fixed bytes,
    plus per-key state for the pool's entries, three ghost lists of at most
    `capacity` blocks and `max_ghost_entries` keys each, and two shadows of
    at most `capacity` blocks each.
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
        shadow_duel_victims: int = 32,
        max_ghost_entries: int = 1 << 16,
        sketch_period_factor: float = 0.6,
        shadow_window_fraction: float = 0.01,
        guard_sample: float = 1.0,
        guard_margin: float = 0.0,
    ) -> None:
        self.capacity = max(num_blocks, 1)
        self.min_window = self.capacity * min_window_fraction
        self.initial_window = max(self.capacity * window_fraction, self.min_window)
        self.window_target = self.initial_window
        self.protected_fraction = protected_fraction
        self.admit_threshold = admit_threshold
        self.probe_every = probe_every
        self.ema_weight = ema_weight
        self.max_duel_victims = max_duel_victims
        self.max_ghost_entries = max_ghost_entries
        self.guard_sample = guard_sample
        self.guard_margin = guard_margin
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
        self._trial: set[str] = set()
        self._refused = _Ghosts(self.capacity, max_ghost_entries)
        """First sightings not saved, kept to learn whether refusing them was right."""
        self._first_sightings = 0
        self.recency_mode = False
        """True while the policy behaves as LRU (see the class docstring)."""
        self.mode_changes = 0
        # The shadows (see `_ShadowLRU`, `_ShadowTinyLFU`) and the current
        # sample: requested blocks, blocks each shadow served.
        self._lru = _ShadowLRU(self.capacity)
        self._tiny = _ShadowTinyLFU(
            self.capacity, shadow_window_fraction, self.sketch, shadow_duel_victims
        )
        self._sample = [0, 0, 0]
        self._sample_blocks = guard_sample * self.capacity
        self._sketch_full_at = self.sketch.width // 4
        """Entries beyond which the sketch grows (to 16 counters a row per entry)."""
        # The last requested key whose size was not known yet (a miss nobody
        # holds): its size comes with `admit` or `on_insert`.
        self._unsized: str | None = None
        # The hash of the last requested key (the admission after a miss reuses it).
        self._last_key: str | None = None
        self._last_hash = 0

    # ----------------------------------------------------------- events

    def on_request(self, key: str) -> None:
        # The hot path (every lookup): one CRC-32, no allocation, lookups inlined.
        digest = zlib.crc32(key.encode())
        self._last_key = key
        self._last_hash = digest
        self.sketch.increment_hash(digest)
        if len(self._blocks) > self._sketch_full_at:
            self._grow_sketch()
        sample = self._sample
        lru = self._lru.order
        blocks = lru.get(key)
        if blocks is not None:
            lru.move_to_end(key)
            sample[1] += blocks
        tiny = self._tiny.window
        tiny_blocks = tiny.get(key)
        if tiny_blocks is None:
            tiny = self._tiny.main
            tiny_blocks = tiny.get(key)
        if tiny_blocks is not None:
            tiny.move_to_end(key)
            sample[2] += tiny_blocks
        size = blocks if blocks is not None else tiny_blocks
        if size is None:
            size = self._blocks.get(key)
        if size is None:
            self._unsized = key  # a miss: its size comes with the save
        else:
            if blocks is None:
                self._lru.insert(key, size)
            if tiny_blocks is None:
                self._tiny.insert(key, size)
            self._count_requested(size)
        if key in self._refused.sizes:
            self._refused.pop(key)
            self._payoff(True)  # a refused first sighting came back soon: saving it would pay
        recency, main = self._ghosts
        if key in recency.sizes:
            blocks = recency.pop(key) or 0
            if not self.recency_mode:
                step = blocks * max(1.0, main.blocks / max(recency.blocks, 1))
                self.window_target = min(self.window_target + step, float(self.capacity))
        elif key in main.sizes:
            blocks = main.pop(key) or 0
            if not self.recency_mode:
                step = blocks * max(1.0, recency.blocks / max(main.blocks, 1))
                self.window_target = max(self.window_target - step, self.min_window)
                self._rebalance()

    def admit(self, key: str, num_blocks: int) -> bool:
        if key == self._unsized:
            self._learn_size(key, num_blocks)
        digest = self._last_hash if key == self._last_key else zlib.crc32(key.encode())
        if self.sketch.estimate_hash(digest) >= 2:
            return True
        if self._let_first_sighting_in(key):
            return True
        for _ in range(self._refused.add(key, num_blocks)):
            self._payoff(False)  # forgotten without coming back: refusing it was right
        return False

    def on_insert(self, key: str, num_blocks: int) -> None:
        if key == self._unsized:  # saved without asking `admit` (a forced save)
            self._learn_size(key, num_blocks)
        self._segment[key] = _WINDOW
        self._blocks[key] = num_blocks
        self._bytes[_WINDOW] += num_blocks
        self._used += num_blocks
        if self._bytes[_WINDOW] > self.window_target:
            self._rebalance()

    def on_evictable(self, key: str, num_blocks: int) -> None:
        segment = self._segment.get(key)
        if segment is None:  # the allocator did not announce it: adopt it
            self.on_insert(key, num_blocks)
            segment = _WINDOW
        self._order[segment][key] = None
        if segment == _WINDOW:
            if self._bytes[_WINDOW] > self.window_target:
                self._rebalance()
        elif segment == _PROTECTED:
            self._demote_protected()  # it may have been held through a demotion

    def on_held(self, key: str) -> None:
        segment = self._segment.get(key)
        if segment is None:
            return
        self._order[segment].pop(key, None)
        if key in self._trial:
            self._trial_outcome(key, paid_off=True)
        if segment == _WINDOW:
            return
        if self.recency_mode or segment == _OUTGOING:
            self._move(key, _WINDOW)  # a loser hit again was worth keeping after all
        elif segment == _PROBATION:
            self._move(key, _PROTECTED)
            self._demote_protected()

    def on_removed(self, key: str) -> None:
        segment = self._segment.pop(key, None)
        if segment is None:
            return
        blocks = self._blocks.pop(key)
        self._bytes[segment] -= blocks
        self._used -= blocks
        self._order[segment].pop(key, None)
        if key in self._trial:
            self._trial_outcome(key, paid_off=False)
        self._ghosts[segment in (_PROBATION, _PROTECTED)].add(key, blocks)

    # ---------------------------------------------------------- queries

    def candidates(self) -> Iterator[str]:
        for segment in (_OUTGOING, _PROBATION, _WINDOW, _PROTECTED):
            yield from self._order[segment]

    @property
    def strict_order(self) -> bool:
        """In recency mode the order is LRU's, and LRU's hit ratio depends on it
        exactly; in frequency mode the duel and the segments carry the
        information, and a window of neighbours weighed by rank does as well."""
        return self.recency_mode

    @property
    def window_share(self) -> float:
        """The window's current target, as a fraction of the pool."""
        return self.window_target / self.capacity

    def segment_blocks(self) -> dict[str, int]:
        """Blocks per segment (window, probation, protected, outgoing)."""
        names = ("window", "probation", "protected", "outgoing")
        return dict(zip(names, self._bytes, strict=True))

    def tracked_keys(self) -> set[str]:
        """Every key the policy keeps state for (entries, ghosts, trials, shadows)."""
        ghosts = self._ghosts[0].keys() | self._ghosts[1].keys() | self._refused.keys()
        shadows = self._lru.keys() | self._tiny.keys()
        return set(self._segment) | ghosts | self._trial | shadows

    # ------------------------------------------------------- the guard

    def _learn_size(self, key: str, blocks: int) -> None:
        """The size of the last requested key, a miss everywhere: the shadows save it."""
        self._unsized = None
        self._lru.insert(key, blocks)
        self._tiny.insert(key, blocks)
        self._count_requested(blocks)

    def _count_requested(self, blocks: int) -> None:
        """Count a request's blocks in the sample; end the sample once it is full."""
        sample = self._sample
        sample[0] += blocks
        if sample[0] >= self._sample_blocks:
            self._end_sample()

    def _grow_sketch(self) -> None:
        sketch = self.sketch
        sketch.resize(len(self._blocks) * 16)
        full = sketch.width >= sketch.max_width
        self._sketch_full_at = len(self._blocks) + (1 << 62) if full else sketch.width // 4

    def _end_sample(self) -> None:
        """Take the side of the shadow that served more of the sample's blocks."""
        requested, lru, tiny = self._sample
        self._sample = [0, 0, 0]
        margin = self.guard_margin * requested
        if not self.recency_mode and lru > tiny + margin:
            self._set_recency_mode(True)
        elif self.recency_mode and tiny > lru + margin:
            self._set_recency_mode(False)

    def _set_recency_mode(self, on: bool) -> None:
        self.recency_mode = on
        self.mode_changes += 1
        self.window_target = float(self.capacity) if on else self.initial_window
        if on:
            # Duel losers are the newest entries outside the window: they join
            # its least recent end, in their order; main drains through
            # probation, which goes first.
            losers = list(self._order[_OUTGOING])
            for key in [k for k, segment in self._segment.items() if segment == _OUTGOING]:
                self._move(key, _WINDOW)
            window = self._order[_WINDOW]
            for key in reversed(losers):
                window.move_to_end(key, last=False)
        self._rebalance()

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
        estimate = self.sketch.estimate
        weighted = covered = seen = 0
        for segment in (_PROBATION, _PROTECTED):
            for victim in self._order[segment]:
                blocks = self._blocks[victim]
                weighted += estimate(victim) * blocks
                covered += blocks
                seen += 1
                if covered >= size or seen >= self.max_duel_victims:
                    break
            if covered >= size or seen >= self.max_duel_victims:
                break
        if covered == 0:
            return True  # nothing in main to protect
        return estimate(candidate) * covered > weighted


class _ShadowLRU:
    """A plain LRU of `capacity` blocks over keys and sizes only (no blocks).

    Holds at most `capacity` blocks (so at most `capacity` keys of one block
    or more; zero-block and larger-than-capacity items are never held).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.order: OrderedDict[str, int] = OrderedDict()
        """Key -> blocks, least recent first; the policy serves hits from it directly."""

    def keys(self) -> set[str]:
        return set(self.order)

    def insert(self, key: str, blocks: int) -> None:
        """Save a missed item, evicting least recent first."""
        if not 0 < blocks <= self.capacity:
            return
        order = self.order
        order[key] = blocks
        self.used += blocks
        while self.used > self.capacity:
            self.used -= order.popitem(last=False)[1]


class _ShadowTinyLFU:
    """The frequency expert: W-TinyLFU over keys and sizes only (no blocks).

    A window LRU of `window_fraction` of `capacity` blocks; its least recent
    items duel (the policy's sketch, block-weighted) for a place in an LRU
    main part holding the rest: against the main items it would push out,
    least recent first, at most `max_victims` of them (as the policy's own
    duel), so a duel costs O(max_victims) however small main's items are.
    Holds at most `capacity` blocks.
    """

    def __init__(
        self,
        capacity: int,
        window_fraction: float,
        sketch: FrequencySketch,
        max_victims: int = 32,
    ) -> None:
        self.window_capacity = max(int(capacity * window_fraction), 1)
        self.main_capacity = max(capacity - self.window_capacity, 0)
        self.sketch = sketch
        self.max_victims = max(max_victims, 1)
        # Key -> blocks, least recent first; the policy serves hits from them directly.
        self.window: OrderedDict[str, int] = OrderedDict()
        self.main: OrderedDict[str, int] = OrderedDict()
        self.window_used = 0
        self.main_used = 0

    def keys(self) -> set[str]:
        return set(self.window) | set(self.main)

    def insert(self, key: str, blocks: int) -> None:
        """Save a missed item in the window; overflow duels for main."""
        if not 0 < blocks <= self.main_capacity:
            return
        window = self.window
        window[key] = blocks
        self.window_used += blocks
        while self.window_used > self.window_capacity:
            candidate, size = window.popitem(last=False)
            self.window_used -= size
            self._offer(candidate, size)

    def _offer(self, candidate: str, size: int) -> None:
        main = self.main
        excess = self.main_used + size - self.main_capacity
        if excess > 0:
            estimate = self.sketch.estimate
            weighted = covered = 0
            for seen, (victim, blocks) in enumerate(main.items(), 1):
                weighted += estimate(victim) * blocks
                covered += blocks
                if covered >= excess or seen >= self.max_victims:
                    break
            if estimate(candidate) * covered <= weighted:
                return  # lost the duel: dropped
            while self.main_used + size > self.main_capacity:
                self.main_used -= main.popitem(last=False)[1]
        main[candidate] = size
        self.main_used += size


class _Ghosts:
    """Keys that recently left, with their sizes: at most `max_blocks` blocks
    and `max_entries` keys (oldest forgotten first). O(1) per operation."""

    def __init__(self, max_blocks: int, max_entries: int) -> None:
        self.max_blocks = max_blocks
        self.max_entries = max_entries
        self.blocks = 0
        self.sizes: OrderedDict[str, int] = OrderedDict()
        """Key -> blocks, oldest first (read directly on the policy's hot path)."""

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def keys(self) -> set[str]:
        return set(self.sizes)

    def add(self, key: str, blocks: int) -> int:
        """Remember `key`; how many older keys were forgotten to make room for it."""
        sizes = self.sizes
        self.blocks += blocks - sizes.pop(key, 0)
        sizes[key] = blocks
        forgotten = 0
        while self.blocks > self.max_blocks or len(sizes) > self.max_entries:
            self.blocks -= sizes.popitem(last=False)[1]
            forgotten += 1
        return forgotten

    def pop(self, key: str) -> int | None:
        blocks = self.sizes.pop(key, None)
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
