"""Claiming the pre-granted leases request-level handles carry.

Runs on the fetcher thread (scheduler process). The handle tasks of one pass
are claimed together: per producer, one claim (a Lookup naming each item's
lease) for all their items and, if this engine knows the producer's NIXL agent
already, one READ of all of them, started before the claim goes out (the
claim's round trip then overlaps the READ). Without the agent, the claim goes
out first and the READ follows its answer (one round trip, as a lookup).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_transfer_nixl.lookups import LOOKUP_ITEMS_MAX
from ec_transfer_nixl.shapes import holds
from ec_transfer_nixl.stages import Stage

if TYPE_CHECKING:
    from ec_core.peer_settings import PeerAddress
    from ec_transfer_nixl.asks import Asks
    from ec_transfer_nixl.links import Links
    from ec_transfer_nixl.lookups import Lookups
    from ec_transfer_nixl.reads import Reads
    from ec_transfer_nixl.shapes import Shapes
    from ec_transfer_nixl.tasks import FetchTask, ItemFetch

Batch = list[tuple["FetchTask", "ItemFetch"]]


class Claims:
    """The handle items taken on in this pass, per producer, until they are claimed.

    Guarantees: an item is claimed only if its handle's lease covers it as asked
    (an accepted shape, spans of exactly its bytes) and its producer may be asked;
    all the handle items of one pass at one producer go in one claim (and one READ)
    per LOOKUP_ITEMS_MAX items; an item whose claim cannot go out is looked up as
    usual instead.
    """

    def __init__(
        self,
        *,
        links: Links,
        asks: Asks,
        lookups: Lookups,
        reads: Reads,
        shapes: Shapes,
    ) -> None:
        self._links = links
        self._asks = asks
        self._lookups = lookups
        self._reads = reads
        self._shapes = shapes
        self._claiming: dict[PeerAddress, list[tuple[FetchTask, list[ItemFetch]]]] = {}
        """Per producer, the handle tasks taken on in this pass and their items its
        leases cover: claimed together at the start of the next pass."""

    @property
    def peers(self) -> list[PeerAddress]:
        """The producers a claim is to go to."""
        return list(self._claiming)

    def take_on(self, task: FetchTask) -> list[ItemFetch]:
        """Queue the claim of `task`'s handle lease (it has one): the items it covers,
        now CLAIMING."""
        handle = task.handle
        assert handle is not None
        link = self._links.link(handle.peer)
        if not self._links.usable(link):
            return []
        claimed: list[ItemFetch] = []
        for key, item in task.items.items():
            shape = handle.shapes.get(key)
            if key not in handle.spans or shape is None:
                continue
            if self._shapes.takes(handle.peer, item, shape) and holds(
                handle.spans[key], self._shapes.nbytes(item.wanted)
            ):
                claimed.append(item)
        if claimed:
            for item in claimed:
                item.move(Stage.CLAIMING)
            self._claiming.setdefault(handle.peer, []).append((task, claimed))
        return claimed

    def flush(self) -> None:
        """Claim the handle leases of the tasks taken on since the last pass: per
        producer, one claim for all their items and, for those whose handle names the
        producer's agent this engine knows, one READ of them all, at once."""
        claiming, self._claiming = self._claiming, {}
        for peer, batch in claiming.items():
            link = self._links.link(peer)
            if not self._links.usable(link):
                for task, items in batch:  # it became so since: asked (and failed) as usual
                    for item in items:
                        item.move(Stage.LOOKING_UP)
                        self._asks.again(task, item)
                continue
            at_once: Batch = []
            after: Batch = []
            for task, items in batch:
                assert task.handle is not None
                known = bool(link.agent) and task.handle.agent == link.agent
                (at_once if known else after).extend((task, item) for item in items)
            for first in range(0, len(at_once), LOOKUP_ITEMS_MAX):
                self._read_and_claim(peer, link.agent, at_once[first : first + LOOKUP_ITEMS_MAX])
            for first in range(0, len(after), LOOKUP_ITEMS_MAX):
                self._claim(peer, after[first : first + LOOKUP_ITEMS_MAX])

    def _claim(self, peer: PeerAddress, batch: Batch) -> None:
        """Claim the handle leases of `batch` without a READ (no metadata for the
        producer's agent yet): their answer is read like a lookup's. Those that cannot
        be claimed are asked as usual."""
        for _, item in batch:
            item.move(Stage.LOOKING_UP)
        wanted = {item.wanted.key: (task, item) for task, item in batch}
        if not self._lookups.ask(peer, wanted, claims=_leases_of(batch)):
            for task, item in batch:
                self._asks.again(task, item)

    def _read_and_claim(self, peer: PeerAddress, agent: str, batch: Batch) -> None:
        """Start one READ of all of `batch` from the spans its handles name, then send
        their claim (one message for all their leases).

        The READ goes first: a send wakes ZeroMQ's threads and, through them, the
        producer's server thread, and on a busy host they take the CPU before a READ
        started after the send could begin (the benchmark's handle fetches were
        slower in that order). Where the READ runs asynchronously (TCP, RDMA) the
        claim's round trip overlaps it all the same."""
        group, unread = self._reads.start_on_handles(peer, agent, batch)
        if unread:
            self._claim(peer, unread)
        if group is None:
            return
        task_of = {id(item): task for task, item in batch}
        wanted = {item.wanted.key: (task_of[id(item)], item) for item in group.items}
        if not self._lookups.ask(peer, wanted, claims=group.claims, group=group):
            self._reads.lapse(group)  # unconfirmed bytes: asked again once the READ is over
        self._reads.poll(group)  # a small READ may be done already


def _leases_of(batch: Batch) -> dict[str, int]:
    """Per item of `batch`, the handle lease it is claimed under."""
    return {item.wanted.key: task.handle.lease for task, item in batch if task.handle is not None}
