"""Giving a producer's pins back: the Release messages a consumer sends.

Runs on the fetcher thread (scheduler process).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import zmq

from ec_transfer_nixl.leases import keys_by_lease
from ec_transfer_nixl.wire import Release, seal

if TYPE_CHECKING:
    from ec_core.peer_secrets import PeerSecrets
    from ec_core.peer_settings import PeerAddress
    from ec_transfer_nixl.links import Link, Links


class Releases:
    """The pins this engine gives back to producers.

    Guarantees: every key of one `send` goes in one Release, grouped by the lease
    that pins it (a key held by no lease is left out); the releases `after_read`
    queues are sent by `flush`, at the end of the pass, after the tasks the READ
    ended are marked done. A Release that cannot be sent at once is not retried:
    the producer's lease then expires by itself.
    """

    def __init__(self, *, links: Links, keys: PeerSecrets, nonces: itertools.count[int]) -> None:
        self._links = links
        self._keys = keys
        self._nonces = nonces
        self._queued: list[tuple[PeerAddress, dict[int, list[str]], bool]] = []
        """Releases to send at the end of this pass: peer, keys by lease, and whether
        the READ under them completed."""

    @property
    def peers(self) -> list[PeerAddress]:
        """The peers a queued Release goes to."""
        return [peer for peer, _, _ in self._queued]

    def send(self, link: Link, leases: Mapping[int, list[str]], *, read: bool = False) -> None:
        """Give back the keys of each lease now (one message for all of them)."""
        if not leases or link.socket is None:
            return
        release = Release(
            nonce=next(self._nonces), sent_at=time.time(), leases=list(leases.items()), read=read
        )
        with contextlib.suppress(zmq.Again):  # else the producer's lease expires by itself
            link.socket.send(seal(release, self._keys.signing), zmq.NOBLOCK)

    def unneeded(self, link: Link, held: Mapping[str, int], keys: list[str]) -> None:
        """Give back at once the pins of `keys` (`held`: the lease of each) that this
        engine will not read."""
        self.send(link, keys_by_lease(held, keys))

    def after_read(self, peer: PeerAddress, granted: Mapping[str, int], *, read: bool) -> None:
        """A READ that will touch the peer's memory no more: queue the pins it was
        granted (`granted`: key -> lease) for this pass's end; `read`: it completed."""
        if granted:
            self._queued.append((peer, keys_by_lease(granted, granted), read))

    def flush(self) -> None:
        """Send the queued releases (to peers that still have a link)."""
        queued, self._queued = self._queued, []
        for peer, leases, read in queued:
            link = self._links.by_peer.get(peer)
            if link is not None:
                self.send(link, leases, read=read)
