"""The `wtinylfu` eviction policy (the default): adaptive, size-weighted W-TinyLFU."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterator

from ec_core.policy_names import WTINYLFU
from ec_core.scheduler_process.first_sightings import FirstSightingGate
from ec_core.scheduler_process.frequency_sketch import FrequencySketch
from ec_core.scheduler_process.shadows import Ghosts, ShadowLRU, ShadowTinyLFU

_WINDOW, _PROBATION, _PROTECTED, _OUTGOING = range(4)


class WTinyLFUPolicy(FirstSightingGate):
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
      out. Items seen before (an estimate of 2 or more) are always saved. A
      key back from a ghost list whose count halving aged to 1 is treated as
      a first sighting, by choice: admitting it too was measured (issue 36)
      and lost on Zipf and session traces. It acts in both modes.
    * **Sketch.** A `FrequencySketch`, `16 x` the entry count wide (grown as
      the pool holds more entries, never past `max_sketch_width` counters a
      row), halved every `sketch_period_factor` widths of requests. A key is
      hashed once per request (the hash is remembered for the admission
      that follows a miss).

    Every event is O(1) amortised, except a duel, which walks at most
    `max_duel_victims` of the victims a candidate would displace (the
    frequency expert's duel at most `shadow_duel_victims`, a bound large enough
    that the benchmark's hit ratios equal an unbounded duel's), and a mode
    change, which moves every entry once (at most once per sample, so O(1)
    amortised over the sample's requests). Memory: the sketch's fixed bytes,
    plus per-key state for the pool's entries, three ghost lists of at most
    `capacity` blocks and `max_ghost_entries` keys each, and two shadows of
    at most `capacity` blocks each.
    """

    name = WTINYLFU

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
            Ghosts(self.capacity, max_ghost_entries),
            Ghosts(self.capacity, max_ghost_entries),
        )
        self.first_sighting_payoff = 1.0
        """Moving average of "a first-sighting save was hit before it left"."""
        self._trial: set[str] = set()
        self._refused = Ghosts(self.capacity, max_ghost_entries)
        """First sightings not saved, kept to learn whether refusing them was right."""
        self._first_sightings = 0
        self.recency_mode = False
        """True while the policy behaves as LRU (see the class docstring)."""
        self.mode_changes = 0
        # The shadows (see `ShadowLRU`, `ShadowTinyLFU`) and the current
        # sample: requested blocks, blocks each shadow served.
        self._lru = ShadowLRU(self.capacity)
        self._tiny = ShadowTinyLFU(
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
