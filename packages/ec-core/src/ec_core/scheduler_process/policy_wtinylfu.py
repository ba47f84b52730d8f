"""The `wtinylfu` eviction policy (the default): adaptive, size-weighted W-TinyLFU."""

from __future__ import annotations

import itertools
import zlib
from collections import OrderedDict
from collections.abc import Iterator

from ec_core.policy_names import WTINYLFU
from ec_core.scheduler_process.first_sightings import FirstSightingGate, payoff_after
from ec_core.scheduler_process.frequency_sketch import FrequencySketch
from ec_core.scheduler_process.shadows import Ghosts, ShadowLRU, ShadowTinyLFU

_WINDOW, _MAIN, _OUTGOING = range(3)
MAX_UNSIZED = 256
"""Requested misses whose sizes the policy waits for at most (`_unsized`)."""


class WTinyLFUPolicy(FirstSightingGate):
    """W-TinyLFU weighted by size, with a frequency-ordered main part and a
    recency mode it falls back to while plain LRU would do better.

    * **Parts.** Every entry belongs to one of: the **window** (LRU, where
      every saved item starts, `window_fraction` of the pool), the **main**
      part, ordered by request frequency (the sketch's estimate when the entry
      last became evictable, aged with the sketch; least recent first among
      equals), or **outgoing** (items that lost their admission duel; they go
      first). Budgets are in blocks, so a 200 MB entry weighs what it occupies.
    * **Admission duel (TinyLFU).** When the window outgrows its share, its
      least recent entry (the candidate) asks to enter the main part. While
      main's share (the pool less the window's) has room for the whole
      candidate, it enters without a duel: the rest of the pool is free blocks
      or duel losers, and a loser kept while main had room would only wait in
      outgoing to be evicted by the next save (on a loop larger than the pool
      outgoing then grows into an LRU of its own, which hits nothing).
      Otherwise it is compared with the *set* of main entries it would
      displace, least frequent first, covering its size: it is admitted when
      its estimated request count, less `duel_margin`, exceeds the highest
      recorded count among them. Not their block-weighted mean: a mean lets
      one rarely asked-for entry among the displaced carry a candidate past
      residents asked for as often as it (measured on Table 1's loop at 5 %,
      with main taking candidates while it has room: 0.52 x the oracle with
      the mean, 0.97 x with the highest). The margin is
      the request that brought the candidate in: a resident asked for as often
      as the candidate keeps its place, so on a loop larger than the pool the
      policy keeps a stable part of the loop instead of replacing each item
      just before its turn comes. A loser moves to outgoing; one requested
      again before it leaves goes back to the window. In frequency mode, a
      missed item holds the same duel in `admit`, against the main entries its
      allocation would evict after the free blocks and the outgoing ones: a
      loser is not saved, so it evicts nothing on its way in (the allocator
      takes its room before the window's duel runs). This holds from the
      first save that overflows the pool: a pool still filling up is no
      reason to let one large item flush the main part (measured on the
      sweep's Zipf 1.0 trace at 20 and 30 %, heavy sizes, in frequency mode
      throughout: 0.815 and 0.820 -> 1.000 and 1.000 x the oracle; the first
      overflow had been exempt).
    * **Victim order** (`candidates`): outgoing (least recent first), main
      (least frequent first, least recent first among equals), window (least
      recent first).
    * **Recency mode (the LRU guard).** A shadow plain LRU of the pool's
      capacity (keys and sizes only, no blocks, so no fragmentation) sees the
      same requests, and so does, for the frequency side, a shadow W-TinyLFU
      with the same window and duel margin and an LRU main part (the
      frequency expert). Once the shadow LRU has been full (before, both
      sides hold everything), after each sample of `guard_sample` pools'
      worth of requested blocks the policy adds (blocks LRU served - blocks
      the frequency side served) / requested blocks to a running score that
      halves each sample: the frequency side is the policy's own hits while
      it is in frequency mode, and the expert's while it is in recency mode.
      In those sums a request weighs its blocks, up to `guard_item_share` of
      the pool: with heavy-tailed sizes one item can be half the pool, and
      at full weight one hit on it decided a sample alone (measured on the
      sweep's Zipf+scans trace at 30 %, heavy sizes: 0.54 x plain LRU, 0.98 x
      with the cap). The shadows of a pool holding more than
      `max_shadow_entries` entries follow a hash sample of its smaller items,
      weighted up (see `_thin_shadows`): a shadow's work per request and its
      memory stay those of about `max_shadow_entries` entries.
      It enters recency mode when the score exceeds `guard_margin`, and
      leaves it when the score falls below `-guard_margin`, so one noisy
      sample does not flip it. A change of mode sets the score back to 0:
      the samples before it weighed LRU against the frequency side of the
      other mode (the expert, or the policy's own hits), so the first sample
      after it decides alone whether the change pays (measured on the sweep's
      independent chat, 10 %, heavy sizes: one sample sent it into frequency
      mode, and the score carried over kept it there a second losing sample:
      0.887 -> 0.982 x plain LRU). During the first `guard_warmup` samples it
      neither enters nor leaves recency mode (the first samples of a cold
      pool are the noisiest: on Table 1's sessions trace at 10 % an early
      excursion into frequency mode cost 1 % of LRU's hits). A sample is one
      pool, the warm-up one sample: a small pool's samples of half a pool
      hold a few dozen requests, and the mode flaps on their noise (the
      CHANGELOG gives what was measured, on the sweep and on held-out seeds,
      `sweep.py --seeds`). It **starts in recency mode** (LRU until the
      frequency side has proved better: a frequency policy has nothing to go
      on in a cold pool). In recency mode
      the window is the whole pool, every hit moves its entry to the window's
      most recent end, no duels happen, so the victim order becomes LRU's as
      the old main entries age out.
      Leaving it, the window shrinks back to its share and its overflow
      duels for the main part. The allocator keeps the policy's order
      exactly in both modes (`strict_order`).
    * **Doorkeeper.** A first sighting (sketch estimate 1) is saved while
      first-sighting saves have been paying off: a moving average of "hit
      before it left the pool". When that falls below `admit_threshold` (a
      stream of one-off images) and below `admit_relative` of the same
      average for saves of items seen before (first sightings that pay
      nearly as well as repeats are not one-offs), only one first sighting
      in `probe_every` is written, so one-offs cost no copy and push nothing
      out. Items seen before (an estimate of 2 or more) are always saved. It
      acts in both modes.
    * **Sketch.** A `FrequencySketch`, `16 x` the entry count wide (grown as
      the pool holds more entries, never past `max_sketch_width` counters a
      row), halved every `sketch_period_factor` widths of requests; each
      halving halves the main part's recorded counts too, so they stay
      comparable with the candidates' estimates. A key is hashed once per
      request (the hash is remembered for the admission that follows a miss,
      and for the unpin that follows a hit).

    Every event is O(1) amortised (a duel reads the main part's blocks per
    count, 16 numbers; the frequency expert's walks at most
    `shadow_duel_victims` entries), except an aging, which
    moves every main entry once per sketch halving (a halving comes after at
    least `sketch_period_factor x 16` requests per entry, so O(1) amortised),
    and a mode change, which moves every entry once (at most once per sample).
    Memory: the sketch's fixed bytes, plus per-key state for the pool's
    entries, a list of refused first sightings of at most `capacity` blocks
    and `max_ghost_entries` keys, two shadows of about `max_shadow_entries`
    keys each, and at most `MAX_UNSIZED` requested misses waiting for their sizes.
    """

    name = WTINYLFU

    def __init__(
        self,
        num_blocks: int = 0,
        *,
        window_fraction: float = 0.01,
        duel_margin: float = 1.0,
        admit_threshold: float = 0.25,
        probe_every: int = 25,
        ema_weight: float = 0.02,
        max_sketch_width: int = 1 << 20,
        shadow_duel_victims: int = 32,
        max_ghost_entries: int = 1 << 16,
        sketch_period_factor: float = 4.0,
        guard_sample: float = 1.0,
        guard_margin: float = 0.08,
        guard_warmup: int = 1,
        guard_item_share: float = 1 / 8,
        max_shadow_entries: int = 256,
        admit_relative: float = 0.7,
    ) -> None:
        self.capacity = max(num_blocks, 1)
        self.initial_window = self.capacity * window_fraction
        self.window_target = float(self.capacity)  # recency mode: the window is the pool
        self.duel_margin = duel_margin
        self.admit_threshold = admit_threshold
        self.probe_every = probe_every
        self.ema_weight = ema_weight
        self.max_ghost_entries = max_ghost_entries
        self.guard_sample = guard_sample
        self.guard_margin = guard_margin
        self.guard_warmup = guard_warmup
        self.sketch = FrequencySketch(
            1024, max_width=max_sketch_width, period_factor=sketch_period_factor
        )
        # Invariant: every key the allocator holds is in `_segment` and
        # `_blocks`, in exactly one part, and its blocks are counted in that
        # part's `_bytes`; the evictable ones, and only those, are in their
        # part's order: `_window` or `_outgoing` (least recent first), or the
        # main bucket of their recorded count (`_buckets[_count[key]]`, least
        # recent first). Every main entry, held or not, has a `_count`.
        self._segment: dict[str, int] = {}
        self._blocks: dict[str, int] = {}
        self._bytes = [0, 0, 0]
        self._window: OrderedDict[str, None] = OrderedDict()
        self._outgoing: OrderedDict[str, None] = OrderedDict()
        self._buckets: list[OrderedDict[str, None]] = [
            OrderedDict() for _ in range(self.sketch.cap + 1)
        ]
        self._count: dict[str, int] = {}
        self._bucket_blocks = [0] * len(self._buckets)
        """Blocks of the entries listed in each main bucket."""
        self._victim_parts = self._parts_in_victim_order()
        self._aged_at = self.sketch.resets
        self._used = 0
        self.first_sighting_payoff = 1.0
        """Moving average of "a first-sighting save was hit before it left"."""
        self._trial: set[str] = set()
        self.admit_relative = admit_relative
        self.repeat_payoff = 1.0
        """Moving average of "a save of an item seen before was hit before it left"."""
        self._repeat_trial: set[str] = set()
        """Saves of items seen before, not hit yet (the evidence for `repeat_payoff`)."""
        self._refused = Ghosts(self.capacity, max_ghost_entries)
        """First sightings not saved, kept to learn whether refusing them was right."""
        self._first_sightings = 0
        self.recency_mode = True
        """True while the policy behaves as LRU (see the class docstring); it
        starts so, and leaves once the frequency expert has proved better."""
        self.mode_changes = 0
        # The shadows (see `ShadowLRU`, `ShadowTinyLFU`) and the current
        # sample: requested blocks, blocks each shadow served.
        self._lru = ShadowLRU(self.capacity)
        self._tiny = ShadowTinyLFU(
            self.capacity, window_fraction, self.sketch, shadow_duel_victims, duel_margin
        )
        self._sample = [0, 0, 0]
        self.guard_item_share = guard_item_share
        self.max_shadow_entries = max_shadow_entries
        self.shadow_rate_bits = 0
        """Below `_big_blocks`, the shadows follow only the items whose key hash
        has this many low bits at 0 (see `_thin_shadows`)."""
        self._shadow_mask = 0
        self._big_blocks = max(self.capacity // max(max_shadow_entries, 1), 1)
        """Items of at least this many blocks are always followed by the shadows."""
        self._sample_blocks = guard_sample * self.capacity
        self._weight_cap = max(int(guard_item_share * self.capacity), 1)
        self._samples = 0
        self.guard_score = 0.0
        """Decaying sum of (LRU - frequency side) / requested over the samples since
        the last change of mode."""
        self._sketch_full_at = self.sketch.width // 4
        """Entries beyond which the sketch grows (to 16 counters a row per entry)."""
        self._unsized: dict[str, bool] = {}
        """Requested keys whose size is not known yet (misses nobody holds), oldest
        first, each with whether it was in the shadows' hash sample: a key's size
        comes with its `admit` or `on_insert`. The scheduler tells the policy of
        an item just before its save, but a caller may tell it of several
        requests first (the lookups of a batch, then their saves): each miss's
        size still reaches the shadows. At most `MAX_UNSIZED` (the oldest go: a
        request need not end in a save)."""
        # The hash of the last requested key (the admission after a miss reuses it).
        self._last_key: str | None = None
        self._last_hash = 0

    # ----------------------------------------------------------- events

    def on_request(self, key: str, held: bool) -> None:
        # The hot path (every lookup): one CRC-32, no allocation, lookups inlined.
        digest = zlib.crc32(key.encode())
        self._last_key = key
        self._last_hash = digest
        sketch = self.sketch
        sketch.increment_hash(digest)
        if sketch.resets != self._aged_at:
            self._age_main()
        if len(self._blocks) > self._sketch_full_at:
            self._grow_sketch()
        sampled = not digest & self._shadow_mask
        # A held key outside the hash sample whose blocks, weighed up by the
        # rates its key was in the sample at, stay below `_big_blocks` is in
        # neither shadow: skip their lookups (`_thin_shadows` says why it cannot
        # be there). Outside the sample, `digest` has a low bit set, and its
        # trailing zero bits are the highest such rate.
        big = self._big_blocks
        if sampled or self._blocks.get(key, big) << (digest & -digest).bit_length() - 1 >= big:
            self._shadow_request(key, sampled)
        if key in self._refused.sizes:
            self._refused.pop(key)
            self._payoff(True)  # a refused first sighting came back soon: saving it would pay
        if held:
            segment = self._segment.get(key)
            if segment is not None:
                self._hit(key, segment)

    def _hit(self, key: str, segment: int) -> None:
        """A request for a key the pool holds ready (`on_request`, after the shadows'
        part, which may have thinned them: the hash sample is read anew). Counted
        here, where the shadows count theirs, and not when the entry is pinned: a pin
        protects an entry, and vLLM pins one again at each step's lookup while its
        request waits (`on_held`)."""
        if not self.recency_mode:  # the frequency side's own hit, as the shadows weigh it
            sampled = not self._last_hash & self._shadow_mask
            weight = self._shadow_blocks(self._blocks[key], sampled)
            if weight is not None:
                self._sample[2] += min(weight, self._weight_cap)
        if key in self._trial:
            self._trial_outcome(key, paid_off=True)
        else:
            self._repeat_outcome(key, paid_off=True)
        if segment != _WINDOW and (self.recency_mode or segment == _OUTGOING):
            self._move(key, _WINDOW)  # (a loser hit again was worth keeping after all)

    def _shadow_request(self, key: str, sampled: bool) -> None:
        """The shadows' side of a request (`sampled`: its key is in their hash sample)."""
        sample = self._sample
        lru = self._lru.order
        blocks = lru.get(key)
        if blocks is not None:
            lru.move_to_end(key)
            sample[1] += min(blocks, self._weight_cap)
        tiny = self._tiny.window
        tiny_blocks = tiny.get(key)
        if tiny_blocks is None:
            tiny = self._tiny.main
            tiny_blocks = tiny.get(key)
        if tiny_blocks is not None:
            tiny.move_to_end(key)
            if self.recency_mode:
                sample[2] += min(tiny_blocks, self._weight_cap)
        size = blocks if blocks is not None else tiny_blocks
        if size is None:
            held = self._blocks.get(key)
            if held is None:  # a miss: its size comes with the save
                unsized = self._unsized
                unsized.pop(key, None)
                unsized[key] = sampled
                if len(unsized) > MAX_UNSIZED:
                    del unsized[next(iter(unsized))]
                return
            size = self._shadow_blocks(held, sampled)
            if size is None:
                return
        if blocks is None:
            self._lru.insert(key, size)
        if tiny_blocks is None:
            self._tiny.insert(key, size)
        self._count_requested(size)

    def admit(self, key: str, num_blocks: int) -> bool:
        if self._unsized:
            self._learn_size(key, num_blocks)
        estimate = self._estimate(key)
        if not self.recency_mode and not self._outranks_displaced(estimate, num_blocks):
            return False
        if estimate >= 2:
            self._repeat_trial.add(key)
            return True
        if self._let_first_sighting_in(key):
            return True
        for _ in range(self._refused.add(key, num_blocks)):
            self._payoff(False)  # forgotten without coming back: refusing it was right
        return False

    def _first_sightings_pay(self) -> bool:
        """Whether first sightings are worth writing: they pay off at least
        `admit_threshold`, or at least `admit_relative` of what saves of items
        seen before pay off (then refusing them would mostly trade hits for
        hits: measured on Table 1's sessions trace at 10 %, 0.990 -> 0.996 x
        plain LRU)."""
        payoff = self.first_sighting_payoff
        return payoff >= self.admit_threshold or payoff >= self.admit_relative * self.repeat_payoff

    def _repeat_outcome(self, key: str, paid_off: bool) -> None:
        """End a save of an item seen before's trial (if on one) in `repeat_payoff`
        (the twin of `_trial_outcome` for first sightings)."""
        if key in self._repeat_trial:
            self._repeat_trial.discard(key)
            self.repeat_payoff = payoff_after(self.repeat_payoff, paid_off, self.ema_weight)

    def _outranks_displaced(self, estimate: int, size: int) -> bool:
        """Whether an item of `size` blocks and request count `estimate` beats
        the main entries its allocation would evict (after the free blocks and
        the duel losers, which go first): the duel, held before anything is
        evicted."""
        needed = size - (self.capacity - self._used) - self._bytes[_OUTGOING]
        return self._outranks(estimate, needed)

    def _outranks(self, estimate: int, needed: int) -> bool:
        """The duel: whether a request count of `estimate`, less `duel_margin`,
        exceeds the highest recorded count among the main entries that
        `needed` blocks would displace, least frequent first (True when
        nothing needs displacing or main has no evictable blocks to protect).

        It reads the buckets' block totals, O(buckets), whatever the number of
        entries, so a large item is weighed against every entry it would
        evict, not only the first few."""
        if needed <= 0:
            return True  # it displaces nothing (a zero-block entry, or room enough)
        covered = top = 0
        for count, blocks in enumerate(self._bucket_blocks):
            if blocks:
                covered += blocks
                top = count
                if covered >= needed:
                    break
        return covered == 0 or estimate - self.duel_margin > top

    def on_insert(self, key: str, num_blocks: int) -> None:
        if self._unsized:  # saved without asking `admit` (a forced save, an adopted entry)
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
        if segment == _WINDOW:
            self._window[key] = None
            if self._bytes[_WINDOW] > self.window_target:
                self._rebalance()
        elif segment == _MAIN:
            count = self._estimate(key)
            self._count[key] = count
            self._list_main(key, count)
        else:
            self._outgoing[key] = None

    def on_held(self, key: str) -> None:
        segment = self._segment.get(key)
        if segment is not None:
            self._unlist(key, segment)  # the hit was counted by its request (`_hit`)

    def on_removed(self, key: str) -> None:
        segment = self._segment.pop(key, None)
        if segment is None:
            return
        self._unlist(key, segment)
        blocks = self._blocks.pop(key)
        self._bytes[segment] -= blocks
        self._used -= blocks
        self._count.pop(key, None)
        if key in self._trial:
            self._trial_outcome(key, paid_off=False)
        else:
            self._repeat_outcome(key, paid_off=False)

    # ---------------------------------------------------------- queries

    def candidates(self) -> Iterator[str]:
        # C iterators only, and only over the non-empty parts: the allocator
        # starts this walk once or twice per save, usually for its first key,
        # and most of the 18 parts are empty (a chain of all of them: ~0.6 us in
        # recency mode; this: ~0.23 us; timeit).
        return itertools.chain.from_iterable(filter(None, self._victim_parts))

    def stats(self) -> dict[str, float]:
        return {
            "policy_lru_mode": 1.0 if self.recency_mode else 0.0,
            "policy_mode_changes": float(self.mode_changes),
        }

    @property
    def strict_order(self) -> bool:
        """Always: in recency mode the order is LRU's, and LRU's hit ratio
        depends on it exactly; in frequency mode the order is by request count,
        and a window of address-adjacent neighbours would evict entries the
        counts rank high (measured on Table 1: byte hit ratio 0.38 instead of
        0.40 at Zipf 0.8, 5 %, and 0.17 instead of 0.23 on the loop at 5 %), at
        the price of more runs per entry (one copy descriptor each)."""
        return True

    @property
    def window_share(self) -> float:
        """The window's current target, as a fraction of the pool."""
        return self.window_target / self.capacity

    def segment_blocks(self) -> dict[str, int]:
        """Blocks per part (window, main, outgoing)."""
        return dict(zip(("window", "main", "outgoing"), self._bytes, strict=True))

    def evictable_in(self, segment: int) -> list[str]:
        """The evictable keys of one part, in victim order (for tests and tools)."""
        if segment == _WINDOW:
            return list(self._window)
        if segment == _OUTGOING:
            return list(self._outgoing)
        return [key for bucket in self._buckets for key in bucket]

    def tracked_keys(self) -> set[str]:
        """Every key the policy keeps state for (entries, refusals, trials, shadows,
        misses waiting for their sizes)."""
        shadows = self._lru.keys() | self._tiny.keys()
        trials = self._trial | self._repeat_trial
        return set(self._segment) | self._refused.keys() | trials | shadows | self._unsized.keys()

    # ------------------------------------------------------- the guard

    def _learn_size(self, key: str, blocks: int) -> None:
        """The size of `key`, if it is a requested miss whose size was not known:
        the shadows save it if they follow it."""
        sampled = self._unsized.pop(key, None)
        if sampled is None:
            return
        weight = self._shadow_blocks(blocks, sampled)
        if weight is not None:
            self._lru.insert(key, weight)
            self._tiny.insert(key, weight)
            self._count_requested(weight)

    def _count_requested(self, blocks: int) -> None:
        """Count a request's blocks in the sample; end the sample once it is full.

        Samples start once the shadow LRU has been full: before that both
        shadows hold everything requested, and their tie says nothing."""
        if len(self._lru.order) > self.max_shadow_entries:
            self._thin_shadows()
        if not self._lru.evicted:
            self._sample = [0, 0, 0]
            return
        sample = self._sample
        sample[0] += min(blocks, self._weight_cap)
        if sample[0] >= self._sample_blocks:
            self._end_sample()

    def _shadow_blocks(self, blocks: int, sampled: bool) -> int | None:
        """What an item of `blocks` blocks weighs in the shadows: its blocks if it
        is big, its blocks times the sampling factor if its key is in the hash
        sample, None (not followed) otherwise."""
        if blocks >= self._big_blocks:
            return blocks
        return blocks << self.shadow_rate_bits if sampled else None

    def _in_hash_sample(self, key: str) -> bool:
        return not self._shadow_mask or not self._hash(key) & self._shadow_mask

    def _thin_shadows(self) -> None:
        """Halve the shadows' sample of small items (spatial sampling, as in SHARDS).

        Shadows of a pool holding many entries cost a dictionary update per
        request that their verdict does not need. Below `_big_blocks` blocks
        (the pool's capacity over `max_shadow_entries`), they follow only the
        items whose key hash has `shadow_rate_bits` low bits at 0, each weighing
        its blocks times 2**`shadow_rate_bits`: in expectation every item
        weighs its blocks, as in the whole shadow, and the guard compares the
        two shadows on the same weighed requests. Bigger items are always
        followed at their own weight (so a few large ones, which can carry most
        of a pool's bytes, add no sampling noise), and at most
        `max_shadow_entries` of them fit. Each halving keeps a shadow entry that
        weighs `_big_blocks` or more as it is, doubles the weight of the other
        entries still in the sample and forgets the rest (unbiased: a kept
        entry weighs in expectation what it weighed); a shadow then holds about
        `max_shadow_entries` keys, whatever the pool holds. O(shadow entries),
        at most 32 times in a policy's life.

        So a shadow entry weighs its blocks, or its blocks times 2**r for a rate
        r at which its key was in the hash sample (r up to the number of
        trailing zero bits of its hash, and up to `shadow_rate_bits`), and one
        that weighs less than `_big_blocks` is in the current hash sample: a key
        of `blocks` blocks outside the sample, with `blocks << r` below
        `_big_blocks` for its hash's r, is in neither shadow (what `on_request`
        relies on to skip them). An item whose size changed under the same key
        may be missed then: the shadows are estimates, nothing depends on their
        exactness but the guard's."""
        if self.shadow_rate_bits >= 32:
            return
        self.shadow_rate_bits += 1
        mask = self._shadow_mask = (1 << self.shadow_rate_bits) - 1
        for key, sampled in self._unsized.items():  # their weights come at the new rate
            self._unsized[key] = sampled and self._in_hash_sample(key)
        big = self._big_blocks

        def weight(key: str, blocks: int) -> int | None:
            if blocks >= big:
                return blocks
            return None if zlib.crc32(key.encode()) & mask else blocks * 2

        self._lru.reweigh(weight)
        self._tiny.reweigh(weight)

    def _grow_sketch(self) -> None:
        sketch = self.sketch
        sketch.resize(len(self._blocks) * 16)
        full = sketch.width >= sketch.max_width
        self._sketch_full_at = len(self._blocks) + (1 << 62) if full else sketch.width // 4

    def _end_sample(self) -> None:
        """Fold the sample into the guard's score; take a side once it is clear."""
        requested, lru, tiny = self._sample
        self._sample = [0, 0, 0]
        self.guard_score = self.guard_score / 2 + (lru - tiny) / requested
        self._samples += 1
        if self._samples <= self.guard_warmup:
            return  # too little evidence yet to leave (or re-enter) the starting mode
        if not self.recency_mode and self.guard_score > self.guard_margin:
            self._set_recency_mode(True)
        elif self.recency_mode and self.guard_score < -self.guard_margin:
            self._set_recency_mode(False)

    def _set_recency_mode(self, on: bool) -> None:
        self.recency_mode = on
        self.mode_changes += 1
        self.guard_score = 0.0  # the evidence was about the other mode (class docstring)
        self.window_target = float(self.capacity) if on else self.initial_window
        if on:
            # Duel losers are the newest entries outside the window: they join
            # its least recent end, in their order; main drains first.
            losers = list(self._outgoing)
            for key in [k for k, segment in self._segment.items() if segment == _OUTGOING]:
                self._move(key, _WINDOW)
            window = self._window
            for key in reversed(losers):
                window.move_to_end(key, last=False)
        else:
            # The window's overflow is what the pool holds, not newcomers: it
            # becomes the main part without duels (against a main part of one
            # entry, every other resident would lose and go first).
            order = self._window
            while self._bytes[_WINDOW] > self.window_target and order:
                self._move(next(iter(order)), _MAIN)

    # -------------------------------------------------------- internals

    def _unlist(self, key: str, segment: int) -> bool:
        """Take `key` out of its part's victim order; whether it was there."""
        if segment == _WINDOW:
            return self._window.pop(key, False) is None
        if segment == _OUTGOING:
            return self._outgoing.pop(key, False) is None
        count = self._count[key]
        if self._buckets[count].pop(key, False) is None:
            self._bucket_blocks[count] -= self._blocks[key]
            return True
        return False

    def _list_main(self, key: str, count: int) -> None:
        """Put the main entry `key` in the victim order, in the bucket of `count`."""
        self._buckets[count][key] = None
        self._bucket_blocks[count] += self._blocks[key]

    def _move(self, key: str, segment: int) -> None:
        old = self._segment[key]
        blocks = self._blocks[key]
        self._bytes[old] -= blocks
        self._bytes[segment] += blocks
        listed = self._unlist(key, old)
        if old == _MAIN:
            del self._count[key]
        self._segment[key] = segment
        if segment == _MAIN:
            count = self._estimate(key)
            self._count[key] = count
            if listed:
                self._list_main(key, count)
        elif listed:
            (self._window if segment == _WINDOW else self._outgoing)[key] = None

    def _age_main(self) -> None:
        """Halve the main part's recorded counts as the sketch halved its counters."""
        shift = self.sketch.resets - self._aged_at
        self._aged_at = self.sketch.resets
        old = self._buckets
        self._buckets = [OrderedDict() for _ in old]
        self._victim_parts = self._parts_in_victim_order()
        blocks = self._bucket_blocks
        self._bucket_blocks = [0] * len(blocks)
        for count, bucket in enumerate(old):
            target = self._buckets[count >> shift]
            for key in bucket:
                target[key] = None
            self._bucket_blocks[count >> shift] += blocks[count]
        for key, count in self._count.items():
            self._count[key] = count >> shift

    def _parts_in_victim_order(self) -> tuple[OrderedDict[str, None], ...]:
        """The parts `candidates` walks, in victim order (rebuilt whenever
        `_buckets` is replaced; the window and outgoing never are)."""
        return (self._outgoing, *self._buckets, self._window)

    def _rebalance(self) -> None:
        """Move the window's least recent entries out while it is over its share."""
        order = self._window
        while self._bytes[_WINDOW] > self.window_target and order:
            candidate = next(iter(order))
            self._move(candidate, _MAIN if self._wins_duel(candidate) else _OUTGOING)

    def _wins_duel(self, candidate: str) -> bool:
        """Whether the candidate should displace the main entries it would push out."""
        size = self._blocks[candidate]
        if self._bytes[_MAIN] + size <= self.capacity - self.window_target:
            return True  # main has room: the rest of the pool is free or outgoing
        return self._outranks(self._estimate(candidate), size)

    def _estimate(self, key: str) -> int:
        """The sketch's count for `key`, reusing the hash of the last request
        when it was for `key` (an admission, or the unpin after a hit)."""
        return self.sketch.estimate_hash(self._hash(key))

    def _hash(self, key: str) -> int:
        """The key's CRC-32, reusing the last request's when it was for `key`."""
        return self._last_hash if key == self._last_key else zlib.crc32(key.encode())
