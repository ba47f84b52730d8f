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


class S3LFUPolicy:
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
            target = 1.0 if paid_off else 0.0
            self.first_sighting_payoff += self.ema_weight * (target - self.first_sighting_payoff)

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


POLICIES: dict[str, type[LRUPolicy] | type[S3LFUPolicy]] = {
    policy.name: policy for policy in (S3LFUPolicy, LRUPolicy)
}
"""Policies by the name users give in the config (`ec_eviction_policy`); each
is built as `POLICIES[name](num_blocks)`."""

DEFAULT_POLICY = S3LFUPolicy.name


def make_policy(name: str, num_blocks: int = 0) -> EvictionPolicy:
    """A fresh policy object for a configured policy name and pool size."""
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}")
    return policy(num_blocks)
