"""The `lru` eviction policy: least recently used first, every miss admitted."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from ec_core.policy_names import LRU


class LRUPolicy:
    """Least recently used first; every missed item is admitted.

    An entry's recency is the last time it became evictable: when its save
    finished, or when the last load that pinned it completed. Close to vLLM's
    in-tree behaviour (FIFO refreshed on reload).
    """

    name = LRU
    strict_order = True
    """Recency is all LRU knows: it is evicted in exactly that order."""

    def __init__(self, num_blocks: int = 0) -> None:
        """`num_blocks` is accepted for a uniform constructor and not needed."""
        self._order: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def on_request(self, key: str, held: bool) -> None:
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

    def stats(self) -> dict[str, float]:
        return {"policy_lru_mode": 1.0}
