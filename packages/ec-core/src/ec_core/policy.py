"""Eviction policies: which evictable entry leaves the region first.

The allocator owns the entries and their states; a policy only orders the
entries the allocator tells it are evictable (ready and unpinned) and names a
victim among them. The allocator never evicts anything a policy names unless
it is evictable, so a policy cannot break the pin and readiness rules.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    """The events an allocator reports, and the one question it asks.

    Every method must be O(log n) or better in the number of entries.
    """

    name: str

    def on_evictable(self, key: str, num_blocks: int) -> None:
        """`key` became evictable: its save finished, or its last pin went."""

    def on_held(self, key: str) -> None:
        """`key` stopped being evictable (it was pinned for a load)."""

    def on_removed(self, key: str) -> None:
        """`key` left the pool (evicted, discarded or dropped)."""

    def victim(self) -> str | None:
        """The evictable key to evict next, or None if there is none."""


class LRUPolicy:
    """Least recently used first.

    An entry's recency is the last time it became evictable: when its save
    finished, or when the last load that pinned it completed. Pinned entries
    are out of the order entirely.
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def on_evictable(self, key: str, num_blocks: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_held(self, key: str) -> None:
        self._order.pop(key, None)

    def on_removed(self, key: str) -> None:
        self._order.pop(key, None)

    def victim(self) -> str | None:
        return next(iter(self._order), None)


POLICIES: dict[str, type[LRUPolicy]] = {LRUPolicy.name: LRUPolicy}
"""Policies by the name users give in the config."""


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy object for a configured policy name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
