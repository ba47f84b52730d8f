"""The control plane of a fetch: Lookups (and claims) sent to peers, and their Replies.

Runs on the fetcher thread (scheduler process).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from ec_transfer_nixl.wire import INCOMPATIBLE, LAPSED, OK, SAVING, SHAPE, Lookup, Reply, seal

if TYPE_CHECKING:
    from ec_core.peer_secrets import PeerSecrets
    from ec_core.peer_settings import PeerAddress
    from ec_transfer_nixl.asks import Asked, Asks
    from ec_transfer_nixl.links import Link, Links
    from ec_transfer_nixl.reads import Leased, ReadGroup, Reads
    from ec_transfer_nixl.releases import Releases
    from ec_transfer_nixl.shapes import Shapes
    from ec_transfer_nixl.tasks import FetchTask

SAVING_RETRY_S = 0.01
"""How soon a peer that is still saving an item is asked again."""
CONNECT_RETRY_S = 0.005
"""How soon a lookup is sent again to a peer whose connection is not up yet."""
LOOKUP_ITEMS_MAX = 256
"""Items per Lookup message; more are asked in several (the producer answers each
under its scheduler's lock, so one message must not hold it long)."""


@dataclass(eq=False)
class Pending:
    """A Lookup (or claim) sent and not answered yet."""

    peer: PeerAddress
    wanted: Asked
    """The items it asked for that are still wanted (key -> task and item)."""
    sent: float
    """When it was sent (a lease it grants cannot have begun before)."""
    group: ReadGroup | None = None
    """A claim's READ started on the handle leases it claims (if one was)."""


class Lookups:
    """The Lookups and claims out, by nonce, and what their Replies decide.

    Guarantees: each Reply is applied at most once, to the Lookup whose nonce it
    names; a Reply whose Lookup is no longer awaited (given up, its tasks done)
    only gives back the leases it granted; every lease a Reply grants for an item
    this engine does not read goes back at once; a peer that answers INCOMPATIBLE
    is never asked again.
    """

    def __init__(
        self,
        *,
        links: Links,
        asks: Asks,
        reads: Reads,
        releases: Releases,
        shapes: Shapes,
        keys: PeerSecrets,
        fingerprint: str,
        nonces: itertools.count[int],
        clock: Callable[[], float],
    ) -> None:
        self._links = links
        self._asks = asks
        self._reads = reads
        self._releases = releases
        self._shapes = shapes
        self._keys = keys
        self._fingerprint = fingerprint
        self._nonces = nonces
        self._clock = clock
        self.pending: dict[int, Pending] = {}
        """Nonce -> the Lookup (or claim) sent with it, while its Reply is awaited."""

    @property
    def peers(self) -> set[PeerAddress]:
        """The peers a Reply is awaited from."""
        return {pending.peer for pending in self.pending.values()}

    def flush(self) -> None:
        """Send the asks queued in this pass: per peer, one Lookup per LOOKUP_ITEMS_MAX
        items still undecided."""
        for peer, wanted in self._asks.take().items():
            entries = [(k, v) for k, v in wanted.items() if v[1].outcome is None]
            for first in range(0, len(entries), LOOKUP_ITEMS_MAX):
                self.ask(peer, dict(entries[first : first + LOOKUP_ITEMS_MAX]))

    def ask(
        self,
        peer: PeerAddress,
        wanted: Asked,
        *,
        claims: dict[str, int] | None = None,
        group: ReadGroup | None = None,
    ) -> bool:
        """Send one Lookup to `peer` for `wanted` (key -> its task and item); with
        `claims` (key -> handle lease), the claim of those leases (and `group`, the
        READ started on them). False if it could not be sent."""
        link = self._links.link(peer)
        now = self._clock()
        if link.incompatible or link.down_until > now:
            answer = "incompatible" if link.incompatible else "unreachable"
            for _, item in wanted.values():
                item.answers[peer] = answer
                item.retry_at.pop(peer, None)
            return False
        nonce = next(self._nonces)
        lookup = Lookup(
            nonce=nonce,
            sent_at=time.time(),
            fingerprint=self._fingerprint,
            items=[(i.wanted.key, i.wanted.rows, i.wanted.cols) for _, i in wanted.values()],
            known_agent=link.agent,
            claims=[claims[key] for key in wanted] if claims else [],
        )
        try:
            assert link.socket is not None  # a link without one is down
            link.socket.send(seal(lookup, self._keys.signing), zmq.NOBLOCK)
        except zmq.Again:
            # Not connected (yet): IMMEDIATE queues nothing for it. Try again soon;
            # at the lookup deadline it counts as unreachable.
            for _, item in wanted.values():
                item.retry_at[peer] = now + CONNECT_RETRY_S
            return False
        self.pending[nonce] = Pending(peer, wanted, now, group)
        self._links.asked(link, now)
        if group is not None:
            group.claim_sent, group.claim_nonce = now, nonce
        for _, item in wanted.values():
            item.asked.add(peer)
            item.retry_at.pop(peer, None)
            item.answers.pop(peer, None)  # asked (again): its answer is awaited
        return True

    def forget(self, nonce: int) -> None:
        """Stop waiting for the Reply to `nonce`: if it comes, it is a late answer, and
        gives back what it leased (see `apply`)."""
        self.pending.pop(nonce, None)

    def forget_task(self, task: FetchTask) -> None:
        """A task is done: its items are wanted from no Lookup any more (a Lookup left
        wanting nothing is forgotten: a late answer releases its leases)."""
        for nonce, pending in list(self.pending.items()):
            for key in task.items:
                pending.wanted.pop(key, None)
            if not pending.wanted:
                del self.pending[nonce]

    def apply(self, link: Link, reply: Reply) -> None:
        """Act on `reply`, received on `link`: per item, read it, ask again later, or
        note the peer's answer; give back every lease not read under."""
        waiting = self.pending.pop(reply.nonce, None)
        held = dict(zip([key for key, _, _ in reply.results], reply.leases, strict=True))
        if waiting is None:  # an answer that came too late: give its leases back
            self._releases.unneeded(link, held, list(held))
            return
        peer, wanted, group = waiting.peer, waiting.wanted, waiting.group
        if reply.status == INCOMPATIBLE:
            self._links.incompatible(peer, link)
            for _, item in wanted.values():
                item.answers[peer] = "incompatible"
            if group is not None:
                self._reads.lapse(group)
            return
        if group is not None:
            self._reads.confirm(group, reply, held)
        not_needed: list[str] = []
        to_read: list[Leased] = []
        shapes = reply.shapes if len(reply.shapes) == len(reply.results) else None
        for at, (key, status, spans) in enumerate(reply.results):
            found = wanted.pop(key, None)  # each key is answered once per lookup
            if group is not None and key in group.claims:
                continue  # the READ started on its claimed lease: decided by confirm
            if found is None or found[1].decided or found[1].reading:
                not_needed.append(key)
                continue
            task, item = found
            item.heard.add(peer)
            offered = shapes[at] if shapes is not None else None
            if status == OK:
                if task.done:
                    not_needed.append(key)
                elif self._shapes.takes(peer, item, offered):
                    to_read.append((task, item, spans, held[key]))
                else:
                    item.answers[peer] = "shape"
                    not_needed.append(key)
            elif status == SAVING:
                item.answers[peer] = "not_ready"
                item.retry_at[peer] = self._clock() + SAVING_RETRY_S
            elif status == LAPSED:  # the handle's lease is gone: ask every peer now
                self._asks.again(task, item)
            elif status == SHAPE:
                item.answers[peer] = "shape"
                self._shapes.refused(peer, item.wanted, offered or (0, 0))
            else:
                item.answers[peer] = "missing"
        if to_read:
            not_needed.extend(self._reads.start(peer, link, reply, to_read, waiting.sent))
        self._releases.unneeded(link, held, not_needed)
