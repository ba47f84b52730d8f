"""Entries a producer pinned for peers, and when each pin goes.

Used by the producer's server thread only. A lease is granted per lookup and
holds one pin per leased key; a key's pin goes when the consumer's READ
is over (the consumer's Release), when the consumer releases it unread, or when
the lease expires.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable


class Leases:
    """Lease id → the keys it still pins, and its expiry (monotonic seconds)."""

    def __init__(
        self, release: Callable[[Iterable[str]], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._release = release
        self._clock = clock
        self._held: dict[int, tuple[float, dict[str, int]]] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._held)

    @property
    def pins(self) -> int:
        """Keys pinned across all leases."""
        return sum(len(keys) for _, keys in self._held.values())

    def grant(self, items: dict[str, int], lease_s: float) -> int:
        """Record pins already taken for `items` (key -> bytes); the lease id (0 if none)."""
        held = dict(items)
        if not held:
            return 0
        lease = next(self._ids)
        self._held[lease] = (self._clock() + lease_s, held)
        return lease

    def give_back(self, lease: int, keys: Iterable[str]) -> list[tuple[str, int]]:
        """Release the named keys of a lease (unknown ones are ignored); `(key, bytes)`
        of those released."""
        record = self._held.get(lease)
        if record is None:
            return []
        _, held = record
        released = [(key, held.pop(key)) for key in dict.fromkeys(keys) if key in held]
        if not held:
            del self._held[lease]
        if released:
            self._release(key for key, _ in released)
        return released

    def expire(self) -> int:
        """Release every lease past its expiry; how many pins went."""
        now = self._clock()
        due = [lease for lease, (until, _) in self._held.items() if until <= now]
        count = 0
        for lease in due:
            _, held = self._held.pop(lease)
            count += len(held)
            self._release(held)
        return count

    def release_all(self) -> None:
        for _, held in self._held.values():
            self._release(held)
        self._held.clear()
