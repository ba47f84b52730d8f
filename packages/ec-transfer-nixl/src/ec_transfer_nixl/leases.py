"""Entries a producer pinned for peers, and when each pin goes.

A lease is granted per lookup (by the server thread) or per request-level
handle (by the scheduler thread, in `request_finished`) and holds one pin per
leased key; a key's pin goes when the consumer's READ is over (the consumer's
Release), when the consumer releases it unread, or when the lease expires. A
handle's lease is *claimable* once: the first consumer that claims it keeps
it (for `lease_s` more); a later claim finds it lapsed.

Thread-safe: its own lock guards the table, and `release` (which takes the
scheduler's lock) is always called after that lock is let go, so the two
locks are never taken in the opposite order from the scheduler thread's.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping

Spans = list[tuple[int, int]]


class Leases:
    """Lease id → the keys it still pins, and its expiry (monotonic seconds)."""

    def __init__(
        self, release: Callable[[Iterable[str]], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._release = release
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[int, tuple[float, dict[str, int]]] = {}
        self._claimable: dict[int, dict[str, Spans]] = {}
        """Handle leases not claimed yet: the spans of each key."""
        # Not 1, 2, 3... at every producer: the secret is shared, so a signed Release
        # or claim meant for one producer (or an earlier run of this one) would name a
        # live lease here. Random start, below 2**53 so a handle's JSON keeps it exact.
        self._ids = itertools.count(secrets.randbelow(2**52) + 1)
        self.active = 0
        """Leases that a consumer is reading (or may read) under: granted by a lookup,
        or claimed. An unclaimed handle lease is not active."""
        self._closed = False
        """Set by `release_all`: no lease is recorded after it (nothing would expire it)."""

    def __len__(self) -> int:
        return len(self._held)

    @property
    def pins(self) -> int:
        """Keys pinned across all leases."""
        with self._lock:
            return sum(len(keys) for _, keys in self._held.values())

    def grant(
        self, items: dict[str, int], lease_s: float, *, claimable: dict[str, Spans] | None = None
    ) -> int:
        """Record pins already taken for `items` (key -> bytes); the lease id (0 if none).

        With `claimable` (key -> spans), a handle's lease: claimable once. After
        `release_all` the pins are released at once and no lease is granted (0): a
        handle granted on the scheduler thread while the server stops must not pin
        its keys forever."""
        held = dict(items)
        if not held:
            return 0
        with self._lock:
            closed = self._closed
            if not closed:
                lease = next(self._ids)
                self._held[lease] = (self._clock() + lease_s, held)
                if claimable is None:
                    self.active += 1
                else:
                    self._claimable[lease] = claimable
        if closed:
            self._release(list(held))
            return 0
        return lease

    def claim(self, lease: int, keys: Iterable[str], lease_s: float) -> dict[str, Spans]:
        """Claim a handle's lease for `keys`: the spans of those it still pins (now
        pinned for `lease_s` more). The lease is claimable no more; its keys not
        claimed are released. Empty when it expired, was claimed, or never existed."""
        return self.claim_many({lease: keys}, lease_s).get(lease, {})

    def claim_many(
        self, claims: Mapping[int, Iterable[str]], lease_s: float
    ) -> dict[int, dict[str, Spans]]:
        """`claim` for each lease -> keys, under one acquisition of this table's lock
        (and one release of what they do not claim); the leases claimed, each with
        the spans of its keys it still pins."""
        claimed: dict[int, dict[str, Spans]] = {}
        dropped: list[str] = []
        with self._lock:
            until = self._clock() + lease_s
            for lease, keys in claims.items():
                spans = self._claimable.pop(lease, None)
                record = self._held.get(lease)
                if spans is None or record is None:
                    continue
                _, held = record
                wanted = set(keys)
                found = {key: spans[key] for key in held if key in wanted and key in spans}
                for key in [key for key in held if key not in found]:
                    del held[key]
                    dropped.append(key)
                if held:
                    self._held[lease] = (until, held)
                    self.active += 1
                    claimed[lease] = found
                else:
                    del self._held[lease]
        if dropped:
            self._release(dropped)
        return claimed

    def give_back(self, lease: int, keys: Iterable[str]) -> list[tuple[str, int]]:
        """Release the named keys of a lease (unknown ones are ignored); `(key, bytes)`
        of those released."""
        return self.give_back_many([(lease, keys)])[0]

    def give_back_many(
        self, returned: Iterable[tuple[int, Iterable[str]]]
    ) -> list[list[tuple[str, int]]]:
        """`give_back` for each `(lease, keys)`, under one acquisition of this table's
        lock (and one release of all their pins); per pair, `(key, bytes)` released."""
        out: list[list[tuple[str, int]]] = []
        with self._lock:
            for lease, keys in returned:
                record = self._held.get(lease)
                if record is None:
                    out.append([])
                    continue
                _, held = record
                out.append([(key, held.pop(key)) for key in dict.fromkeys(keys) if key in held])
                if not held:
                    self._drop(lease)
        released = [key for pairs in out for key, _ in pairs]
        if released:
            self._release(released)
        return out

    def expire(self) -> int:
        """Release every lease past its expiry; how many pins went."""
        now = self._clock()
        keys: list[str] = []
        with self._lock:
            due = [lease for lease, (until, _) in self._held.items() if until <= now]
            for lease in due:
                keys.extend(self._held[lease][1])
                self._drop(lease)
        if keys:
            self._release(keys)
        return len(keys)

    def release_all(self) -> None:
        """Release every lease; from now on `grant` records none (it releases its pins)."""
        with self._lock:
            self._closed = True
            keys = [key for _, held in self._held.values() for key in held]
            self._held.clear()
            self._claimable.clear()
            self.active = 0
        if keys:
            self._release(keys)

    def _drop(self, lease: int) -> None:
        del self._held[lease]
        if self._claimable.pop(lease, None) is None:
            self.active -= 1


def keys_by_lease(held: Mapping[str, int], keys: Iterable[str]) -> dict[int, list[str]]:
    """`keys` grouped by the lease `held` names for each, in order (a key held by no
    lease, 0 or absent, is left out)."""
    out: dict[int, list[str]] = {}
    for key in keys:
        lease = held.get(key, 0)
        if lease:
            out.setdefault(lease, []).append(key)
    return out
