"""The consumer's connections to its peers: one DEALER socket per peer, and whether
the peer may be asked now.

Runs on the fetcher thread (scheduler process), as do all its callers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from ec_core._vllm import get_logger
from ec_core.ratelimit import RateLimitedWarnings
from ec_transfer_nixl.sockets import peer_socket
from ec_transfer_nixl.wire import Reply, WireError, open_frame

if TYPE_CHECKING:
    from ec_core.peer_secrets import PeerSecrets
    from ec_core.peer_settings import PeerAddress
    from ec_transfer_nixl.agent import RegionAgent

logger = get_logger(__name__)

DOWN_FOR_S = 5.0
"""How long a peer that did not answer is not asked."""
LINKS_MAX = 256
"""Links kept to peers; beyond it, those no open fetch uses are dropped (handles,
client input, may name any number of producers; ZeroMQ allows 1023 sockets)."""
LATE_REPLY_S = 5.0
"""A link asked this recently is not dropped as idle: a reply that comes after its
fetch was given up is still read, and its leases released (a closed socket would
leave them pinned at the producer until they expire)."""


@dataclass
class Link:
    """The DEALER socket to one peer and what this engine knows of the peer."""

    socket: zmq.Socket[Any] | None
    """None: ZeroMQ refused a socket for the peer (it is down until `down_until`)."""
    down_until: float = 0.0
    incompatible: bool = False
    agent: str = ""
    """The peer's NIXL agent this engine knows (its metadata was added)."""
    asked_at: float = -math.inf
    """When a lookup was last sent on it (the fetcher's clock)."""


class Links:
    """The links to peers, keyed by peer address.

    Guarantees: at most one link per peer address; a peer whose link is down
    (unreachable, or refused a socket) is not asked again before `down_until`,
    and an incompatible one never again; there are no more than LINKS_MAX links
    but for those `drop_idle` is told are busy; a peer's NIXL agent is forgotten
    only with the last link that knows it; every socket is closed by `close`.
    """

    def __init__(
        self,
        *,
        context: zmq.Context[Any],
        keys: PeerSecrets,
        agent: Callable[[], RegionAgent],
        warnings: RateLimitedWarnings,
        clock: Callable[[], float],
        busy: Callable[[], Set[PeerAddress]],
    ) -> None:
        self._context = context
        self._keys = keys
        self._agent = agent
        self._warnings = warnings
        self._clock = clock
        self._busy = busy
        """The peers open work uses: their links are kept however many there are."""
        self.by_peer: dict[PeerAddress, Link] = {}
        """Peer -> its link (written here only; others read it)."""
        self._poller: zmq.Poller | None = None
        """Built again only once a link was added or dropped."""

    def link(self, peer: PeerAddress) -> Link:
        """The link to `peer`, made if there is none (or its socket was refused and it
        is down no more); past LINKS_MAX, idle links go first."""
        link = self.by_peer.get(peer)
        if link is None or (link.socket is None and link.down_until <= self._clock()):
            if link is None and len(self.by_peer) >= LINKS_MAX:
                self.drop_idle(self._busy())
            sock = None
            try:
                sock = peer_socket(self._context, zmq.DEALER, peer)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a peer not connected
                sock.connect(peer.endpoint)
                link = Link(sock)
            except zmq.ZMQError as exc:  # e.g. an address it cannot parse, or no sockets left
                if sock is not None:
                    sock.close(0)
                # One tag for all such peers: a handle may name any number of them.
                self._warnings.warn("link", "EC CPU tier: cannot connect to %s: %s", peer, exc)
                link = Link(None, down_until=self._clock() + DOWN_FOR_S)
            self.by_peer[peer] = link
            self._poller = None
        return link

    def asked(self, link: Link, now: float) -> None:
        """A lookup went out on `link` at `now` (it is kept a while for a late reply)."""
        link.asked_at = now

    def incompatible(self, peer: PeerAddress, link: Link) -> None:
        """`peer` (on `link`) runs an incompatible engine: it is never asked again
        (said once)."""
        if not link.incompatible:
            logger.warning(
                "EC CPU tier: peer %s runs an incompatible engine (model, dtype, "
                "embedding width, block size or wire version differ); it is not asked "
                "again and its items are encoded here",
                peer,
            )
        link.incompatible = True

    def usable(self, link: Link) -> bool:
        """Whether the peer of `link` may be asked now (compatible, and not down)."""
        return not link.incompatible and link.down_until <= self._clock()

    def drop_idle(self, busy: Set[PeerAddress]) -> None:
        """Close the links of peers not in `busy` (those no open fetch, READ or message
        to send uses) and not asked in the last LATE_REPLY_S."""
        late = self._clock() - LATE_REPLY_S
        dropped: set[str] = set()
        for peer in [peer for peer in self.by_peer if peer not in busy]:
            link = self.by_peer[peer]
            if link.asked_at > late:
                continue
            del self.by_peer[peer]
            if link.socket is not None:
                link.socket.close(0)
            if link.agent:
                dropped.add(link.agent)
        # A producer reached under two addresses (a handle's and an `ec_peers` entry)
        # has one agent for both links: it is forgotten only with its last link.
        for agent in dropped - {link.agent for link in self.by_peer.values()}:
            self._agent().forget(agent)
        self._poller = None

    def down(self, peer: PeerAddress, why: str) -> None:
        """Ask `peer` nothing for DOWN_FOR_S (said once in a rate-limited warning)."""
        link = self.by_peer.get(peer)
        if link is None:
            return  # dropped as idle since: the next ask makes it again
        if link.down_until <= self._clock():
            self._warnings.warn(
                f"down:{peer}",
                "EC CPU tier: peer %s is not asked for %.0f s: %s (items are encoded here)",
                peer,
                DOWN_FOR_S,
                why,
            )
        link.down_until = self._clock() + DOWN_FOR_S

    def poller(self, wakes: Any) -> zmq.Poller:
        """A poller over every link's socket and `wakes` (kept until a link changes)."""
        poller = self._poller
        if poller is None:
            poller = self._poller = zmq.Poller()
            poller.register(wakes, zmq.POLLIN)
            for link in self.by_peer.values():
                if link.socket is not None:
                    poller.register(link.socket, zmq.POLLIN)
        return poller

    def replies(self, events: dict[Any, int]) -> Iterator[tuple[Link, Reply]]:
        """The authentic replies waiting on the sockets `events` reports readable, each
        with its link; a frame that does not open, or a reply that does not name one
        lease per result, is dropped with a rate-limited warning."""
        for link in list(self.by_peer.values()):
            sock = link.socket
            if sock is None or sock not in events:
                continue
            # EVENTS is read without letting go of the GIL; a recv that finds nothing
            # would let go of it (and wait to take it back) only to raise.
            while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                frame = sock.recv(zmq.NOBLOCK)
                try:
                    reply = open_frame(frame, self._keys.accepted)
                except WireError as exc:
                    self._warnings.warn("bad-reply", "EC CPU tier: dropped a peer reply: %s", exc)
                    continue
                if not isinstance(reply, Reply):
                    continue
                if len(reply.leases) != len(reply.results):
                    self._warnings.warn(
                        "bad-reply", "EC CPU tier: dropped a peer reply: not one lease per result"
                    )
                    continue
                yield link, reply

    def know(self, link: Link, reply: Reply) -> str:
        """The name to READ from the reply's agent (its metadata added if new)."""
        if reply.agent != link.agent:
            if not reply.agent_metadata:
                raise RuntimeError(f"no metadata for the peer's NIXL agent {reply.agent}")
            agent = self._agent()
            if link.agent:
                agent.forget(link.agent)  # the peer restarted: a new agent
            agent.know(reply.agent, reply.agent_metadata)
            link.agent = reply.agent
        return link.agent

    def close(self) -> None:
        """Close every link's socket (a socket left open would hang the context's
        term(), and with it the engine's shutdown)."""
        for link in self.by_peer.values():
            if link.socket is not None:
                link.socket.close(0)
