"""What the `wtinylfu` policy remembers of keys without holding them (keys and sizes only).

`Ghosts` are keys remembered after they left (the doorkeeper's
refusals); `ShadowLRU` and `ShadowTinyLFU` are the two shadow caches its LRU
guard compares (see `ec_core.scheduler_process.policy_wtinylfu`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ec_core.scheduler_process.frequency_sketch import FrequencySketch


def _reweighed(
    items: OrderedDict[str, int], weight: Callable[[str, int], int | None]
) -> OrderedDict[str, int]:
    """`items` in order, each with the blocks `weight(key, blocks)` gives (None: left out)."""
    kept: OrderedDict[str, int] = OrderedDict()
    for key, blocks in items.items():
        new = weight(key, blocks)
        if new is not None:
            kept[key] = new
    return kept


class ShadowLRU:
    """A plain LRU of `capacity` blocks over keys and sizes only (no blocks).

    Holds at most `capacity` blocks (so at most `capacity` keys of one block
    or more; zero-block and larger-than-capacity items are never held).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.order: OrderedDict[str, int] = OrderedDict()
        """Key -> blocks, least recent first; the policy serves hits from it directly."""
        self.evicted = False
        """Whether it has ever let an item go for lack of room."""

    def keys(self) -> set[str]:
        return set(self.order)

    def reweigh(self, weight: Callable[[str, int], int | None]) -> None:
        """Give every item the blocks `weight(key, blocks)` says (None: forget it),
        keeping the order; then evict least recent first while over capacity."""
        order = self.order = _reweighed(self.order, weight)
        self.used = sum(order.values())
        while self.used > self.capacity:
            self.used -= order.popitem(last=False)[1]
            self.evicted = True

    def insert(self, key: str, blocks: int) -> None:
        """Save a missed item, evicting least recent first (a key held already is
        replaced: its blocks count once)."""
        order = self.order
        self.used -= order.pop(key, 0)
        if not 0 < blocks <= self.capacity:
            return
        order[key] = blocks
        self.used += blocks
        while self.used > self.capacity:
            self.used -= order.popitem(last=False)[1]
            self.evicted = True


class ShadowTinyLFU:
    """The frequency expert: W-TinyLFU over keys and sizes only (no blocks).

    A window LRU of `window_fraction` of `capacity` blocks; its least recent
    items duel (the policy's sketch) for a place in an LRU main part holding
    the rest: the candidate's estimate less `margin` against the
    block-weighted mean estimate of the main items it would push out, least
    recent first, at most `max_victims` of them, so a duel costs
    O(max_victims) however small main's items are. (The policy's own duel
    differs: it weighs the highest count among everything it displaces.)
    Holds at most `capacity` blocks.
    """

    def __init__(
        self,
        capacity: int,
        window_fraction: float,
        sketch: FrequencySketch,
        max_victims: int = 32,
        margin: float = 0.0,
    ) -> None:
        self.window_capacity = max(int(capacity * window_fraction), 1)
        self.main_capacity = max(capacity - self.window_capacity, 0)
        self.sketch = sketch
        self.max_victims = max(max_victims, 1)
        self.margin = margin
        # Key -> blocks, least recent first; the policy serves hits from them directly.
        self.window: OrderedDict[str, int] = OrderedDict()
        self.main: OrderedDict[str, int] = OrderedDict()
        self.window_used = 0
        self.main_used = 0

    def keys(self) -> set[str]:
        return set(self.window) | set(self.main)

    def reweigh(self, weight: Callable[[str, int], int | None]) -> None:
        """Give every item the blocks `weight(key, blocks)` says (None: forget it),
        keeping each part's order; main then loses its least recent items while
        over its share, and the window's overflow duels as usual."""
        main = self.main = _reweighed(self.main, weight)
        self.main_used = sum(main.values())
        while self.main_used > self.main_capacity:
            self.main_used -= main.popitem(last=False)[1]
        window = _reweighed(self.window, weight)
        self.window = OrderedDict()
        self.window_used = 0
        for key, blocks in window.items():
            self.insert(key, blocks)

    def insert(self, key: str, blocks: int) -> None:
        """Save a missed item in the window; overflow duels for main (a key held
        already, in either part, is replaced: its blocks count once)."""
        window = self.window
        self.window_used -= window.pop(key, 0)
        self.main_used -= self.main.pop(key, 0)
        if not 0 < blocks <= self.main_capacity:
            return
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
            score = estimate(candidate) - self.margin
            if score <= 0:
                return  # lost: no main item's estimate is below 0
            weighted = covered = 0
            for seen, (victim, blocks) in enumerate(main.items(), 1):
                weighted += estimate(victim) * blocks
                covered += blocks
                if covered >= excess or seen >= self.max_victims:
                    break
            if score * covered <= weighted:
                return  # lost the duel: dropped
            while self.main_used + size > self.main_capacity:
                self.main_used -= main.popitem(last=False)[1]
        main[candidate] = size
        self.main_used += size


class Ghosts:
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
