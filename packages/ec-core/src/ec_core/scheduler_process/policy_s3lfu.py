"""The `s3lfu` eviction policy: a probation queue and ghost list in front of LFU with aging."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator

from sortedcontainers import SortedList

from ec_core.policy_names import S3LFU
from ec_core.scheduler_process.first_sightings import FirstSightingGate


class _History:
    """Decaying request counts per key (how popular an item has been lately).

    When more than `limit` keys are tracked, every count is halved and keys
    that reach zero are forgotten: memory stays bounded and old popularity
    fades. `limit` is at least `floor` and follows the pool's entry count
    (`follow`), down as well as up. Amortised O(1): a halving pass over m keys
    happens at most once per m/2 new keys (a few passes in a row when the
    limit has just dropped far).
    """

    def __init__(self, limit: int) -> None:
        self.floor = max(limit, 64)
        self.limit = self.floor
        self.counts: dict[str, int] = {}

    def follow(self, entries: int) -> None:
        """Allow 8 keys per entry the pool holds (history must outlive the
        entries it ranks), never fewer than `floor`."""
        self.limit = max(self.floor, 8 * entries)

    def touch(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
        if len(self.counts) > self.limit:
            self.counts = {k: c >> 1 for k, c in self.counts.items() if c > 1}

    def get(self, key: str) -> int:
        return self.counts.get(key, 0)


class S3LFUPolicy(FirstSightingGate):
    """Adaptive admission and a probation queue in front of LFU with aging.

    * **Probation.** A saved item first enters probation (`small`, FIFO),
      unless it is one of the last `ghost_entries` items that left probation
      without a hit (the **ghost** list): then it goes straight to main — it
      came back right after being dropped. A request for a probationary entry
      whose save has finished (a hit) promotes it to main. Victims come from
      probation, oldest first, while it holds more than `small_fraction` of the
      pool; otherwise from main. (A short ghost list measured best: a long one
      lets lukewarm items displace main entries on Zipf traffic.)
    * **Main** evicts by LFU with dynamic aging: priority = L + recent request
      count, where L is the priority of the last main entry evicted, so entries
      popular long ago age out and recurring ones stay.
    * **Adaptive admission.** An item seen before (or in the ghost list) is
      always saved. A first sighting is saved while first sightings have been
      paying off: the policy tracks, as a moving average, how often an entry
      saved at its first sighting was asked for again, saved, before leaving
      probation. When that falls below `admit_threshold` (a workload full of
      one-off images) only
      one first sighting in `probe_every` is saved — enough to notice when the
      workload changes — and the rest are never written, so they cannot push
      anything out. When first sightings recur (chat turns re-send recent
      images), they are all saved.

    It is S3-FIFO's structure (probation + ghost) with an LFU-DA main part and
    a TinyLFU-like doorkeeper that switches itself on and off.
    """

    name = S3LFU
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
        self._main: SortedList = SortedList()  # (priority, seq, key) of evictable main keys
        self._main_key: dict[str, tuple[float, int]] = {}
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._trial: set[str] = set()  # saved at first sighting, outcome pending
        self._first_sightings = 0
        self._aging = 0.0
        self._seq = itertools.count()
        self._history = _History(limit=1 << 16)

    # ----------------------------------------------------------- events

    def on_request(self, key: str, held: bool) -> None:
        self._history.touch(key)
        self._history.follow(len(self._blocks))
        if held and key in self._in_small:
            # A hit on an entry on probation: promote it. Here, not when it is
            # pinned: vLLM pins an entry again at each step's lookup while its
            # request waits, and a pin is no request (`on_held`).
            self._trial_outcome(key, paid_off=True)
            self._in_small.discard(key)
            self._small_blocks -= self._blocks.get(key, 0)
            if self._small.pop(key, False) is None:  # it was evictable: main lists it now
                self.on_evictable(key, self._blocks.get(key, 0))

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

    def stats(self) -> dict[str, float]:
        return {"policy_lru_mode": 0.0}
