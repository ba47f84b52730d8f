"""The data plane of a fetch: NIXL READs into reserved local blocks, and how each ends.

Runs on the fetcher thread (scheduler process).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ec_core.peer_settings import LEASE_MARGIN_S
from ec_core.ratelimit import RateLimitedWarnings
from ec_transfer_nixl.agent import RegionAgent, Span, paired_spans
from ec_transfer_nixl.stages import Stage
from ec_transfer_nixl.wire import LAPSED, OK, Reply

if TYPE_CHECKING:
    from ec_core.peer_settings import PeerAddress
    from ec_scheduler.remote import LocalEntries
    from ec_transfer_nixl.asks import Asks
    from ec_transfer_nixl.counters import PeerCounters
    from ec_transfer_nixl.deadlines import Deadlines
    from ec_transfer_nixl.links import Link, Links
    from ec_transfer_nixl.quarantine import Quarantine
    from ec_transfer_nixl.releases import Releases
    from ec_transfer_nixl.shapes import Shapes
    from ec_transfer_nixl.tasks import FetchTask, ItemFetch

Leased = tuple["FetchTask", "ItemFetch", list[tuple[int, int]], int]
"""An item a Reply leased: its task, the item, the peer's spans, and the lease."""


@dataclass(eq=False)
class ReadGroup:
    """One NIXL READ of the items one Reply leased (of one or several tasks), or of
    the items of the handle leases one claim names (of one or several tasks).

    It is given up at `deadline`, the earliest of its tasks' deadlines (tasks
    asked in one pass have nearly the same), and trusted only if it ends before
    `lease_until`. A READ started on handle leases is not trusted at all until
    its claim is answered (`answered`; `claim_deadline` bounds that wait); then
    its items whose claim was refused (`refused`) are asked again, the others
    land or fail together.
    """

    handle: Any
    peer: PeerAddress
    items: list[ItemFetch]
    started: float
    lease_until: float
    deadline: float
    granted: dict[str, int] = field(default_factory=dict)
    """Per item, the lease the producer granted this engine that pins it: given back
    once the READ is over. A handle's lease is in only once its claim was answered
    with it: another engine may hold a handle's lease this one failed to claim."""
    answered: bool = True
    claims: dict[str, int] = field(default_factory=dict)
    """Handle READs: per key, the handle lease it is claimed under."""
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Handle READs: the spans read per key (the claim must confirm the same)."""
    refused: set[str] = field(default_factory=set)
    """Handle READs: the keys whose claim lapsed, was refused or named other spans:
    their bytes are not the entry's for sure."""
    claim_sent: float = 0.0
    claim_nonce: int = 0
    claim_deadline: float = math.inf
    ended: str | None = None
    """Handle READs over before their claim was answered: "DONE" or "ERR"."""
    ended_at: float = 0.0


class Reads:
    """The READs that run, and the handle READs over but not yet confirmed.

    Guarantees: an item's bytes land (its entry made ready) only from a READ that
    completed within its lease and, on a handle's lease, only once the producer
    confirmed that lease still pinned those very spans; a READ's blocks are freed
    only once NIXL has let go of it (else it goes to quarantine); every READ's pins
    are given back once it is over.
    """

    def __init__(
        self,
        *,
        local: LocalEntries,
        spans: Callable[[tuple[tuple[int, int], ...], int], list[Span]],
        shapes: Shapes,
        agent: Callable[[], RegionAgent],
        counters: PeerCounters,
        links: Links,
        releases: Releases,
        deadlines: Deadlines,
        asks: Asks,
        quarantine: Quarantine,
        forget_claim: Callable[[int], None],
        warnings: RateLimitedWarnings,
        clock: Callable[[], float],
    ) -> None:
        self._local = local
        self._spans = spans
        self._shapes = shapes
        self._agent = agent
        self._counters = counters
        self._links = links
        self._releases = releases
        self._deadlines = deadlines
        self._asks = asks
        self._quarantine = quarantine
        self._forget_claim = forget_claim
        self._warnings = warnings
        self._clock = clock
        self.running: list[ReadGroup] = []
        """READs NIXL is running."""
        self.awaiting: list[ReadGroup] = []
        """Handle READs that are over, waiting for their claim's answer."""
        self.handle_reads = 0
        """Items READ on a handle's lease before any answer (for tests and benchmarks)."""
        self.handle_batches = 0
        """NIXL READs those were read with (one per producer and pass)."""

    @property
    def peers(self) -> set[PeerAddress]:
        """The peers a READ here reads from."""
        return {group.peer for group in (*self.running, *self.awaiting)}

    # ------------------------------------------------------------- starting

    def _reserve(
        self, items: list[ItemFetch]
    ) -> tuple[list[ItemFetch], list[tuple[Span, ...]], list[ItemFetch]]:
        """Blocks for `items`, under one lock acquisition: those reserved and their
        spans here, and those that found no room (failed: no_space)."""
        runs = self._local.reserve_many(
            [(i.wanted.key, i.wanted.rows, i.wanted.cols) for i in items]
        )
        reserved, spans, full = [], [], []
        for item, got in zip(items, runs, strict=True):
            if got is None:
                self._deadlines.finish(item, "no_space")
                full.append(item)
            else:
                reserved.append(item)
                spans.append(tuple(self._spans(got, self._shapes.nbytes(item.wanted))))
        return reserved, spans, full

    def start(
        self, peer: PeerAddress, link: Link, reply: Reply, leased: list[Leased], sent: float
    ) -> list[str]:
        """Reserve blocks for the items a lookup's `reply` leased and start one READ of
        them all; the keys not being read (their pins can go back at once). `sent`:
        when the lookup went out (the lease began no earlier)."""
        not_read: list[str] = []
        fitting: list[Leased] = []
        for task, item, remote, lease in leased:
            if self._shapes.fits(peer, item, remote):
                fitting.append((task, item, remote, lease))
            else:
                item.answers[peer] = "shape"
                not_read.append(item.wanted.key)
        reserved, local_spans, full = self._reserve([item for _, item, _, _ in fitting])
        not_read.extend(item.wanted.key for item in full)
        if not reserved:
            return not_read
        of = {id(item): (task, remote, lease) for task, item, remote, lease in fitting}
        pieces: list[tuple[Span, Span]] = []
        for item, here in zip(reserved, local_spans, strict=True):
            pieces.extend(paired_spans(here, of[id(item)][1]))
        try:
            name = self._links.know(link, reply)
            # No NIXL notification: the READ then completes here without waiting for
            # the producer to poll; the Release sent when it is over unpins the entries.
            handle = self._agent().read(name, pieces)
        except Exception as exc:
            # Nothing was enqueued (or NIXL refused it at once): the blocks are free.
            self._local.abandon_many([item.wanted.key for item in reserved])
            for item in reserved:
                item.answers[peer] = "read_error"
                not_read.append(item.wanted.key)
            self._warnings.warn("read", "EC CPU tier: a READ from %s failed: %s", peer, exc)
            return not_read
        group = ReadGroup(
            handle=handle,
            peer=peer,
            items=reserved,
            started=self._clock(),
            lease_until=sent + reply.lease_s - LEASE_MARGIN_S,
            deadline=min(of[id(item)][0].deadline for item in reserved),
            granted={item.wanted.key: of[id(item)][2] for item in reserved},
        )
        for item in reserved:
            item.move(Stage.READING)
        self.running.append(group)
        self.poll(group)  # a small READ may be done already
        return not_read

    def start_on_handles(
        self, peer: PeerAddress, agent: str, batch: list[tuple[FetchTask, ItemFetch]]
    ) -> tuple[ReadGroup | None, list[tuple[FetchTask, ItemFetch]]]:
        """Reserve blocks for `batch` (handle items, their handles naming the producer's
        agent `agent`) and start one READ of them all from the spans their handles name,
        not yet trusted: the READ, or None if none started; and the items to claim
        without a READ (NIXL refused it at once: their blocks are free again)."""
        reserved, local_spans, _ = self._reserve([item for _, item in batch])
        if not reserved:
            return None, []  # those without room failed: no_space
        task_of = {id(item): task for task, item in batch}
        tasks = [task_of[id(item)] for item in reserved]
        claims = {
            item.wanted.key: task.handle.lease for task, item in batch if task.handle is not None
        }
        remote = {
            item.wanted.key: task.handle.spans[item.wanted.key]
            for task, item in zip(tasks, reserved, strict=True)
            if task.handle is not None
        }
        group = ReadGroup(
            handle=None,
            peer=peer,
            items=reserved,
            started=self._clock(),
            lease_until=-math.inf,  # set once the claim is answered
            deadline=min(task.deadline for task in tasks),
            answered=False,
            claims={key: claims[key] for key in remote},
            spans=remote,
            claim_deadline=min(task.lookup_deadline for task in tasks),
        )
        pieces: list[tuple[Span, Span]] = []
        for item, here in zip(reserved, local_spans, strict=True):
            pieces.extend(paired_spans(here, remote[item.wanted.key]))
        try:
            group.handle = self._agent().read(agent, pieces)
        except Exception as exc:
            # Nothing enqueued: the blocks are free; claimed as by an engine that does
            # not know the agent (a READ after the answer).
            self._local.abandon_many(list(remote))
            self._warnings.warn("read", "EC CPU tier: a READ from %s failed: %s", peer, exc)
            return None, [(task_of[id(item)], item) for item in reserved]
        for item in reserved:
            item.move(Stage.READING)
        self.running.append(group)
        self.handle_reads += len(reserved)
        self.handle_batches += 1
        return group, []

    # ------------------------------------------------------------ progress

    def check(self, now: float) -> None:
        """Give up the READs past their deadline (or past their claim's), poll the
        others, and fail the READs over whose claim got no answer in time."""
        for group in list(self.running):
            if now > group.deadline or (not group.answered and now > group.claim_deadline):
                self.give_up(group)
            else:
                self.poll(group)
        for group in list(self.awaiting):
            if now > group.claim_deadline:
                self._claim_unanswered(group)

    def poll(self, group: ReadGroup) -> None:
        """Settle `group` if its READ is over (or wait for its claim's answer)."""
        agent = self._agent()
        state = agent.state(group.handle)
        if state == "PROC":
            return
        if not agent.release(group.handle) and state != "DONE":
            # Failed, yet NIXL keeps the transfer: it may still write the blocks, so
            # they stay reserved (quarantined) until NIXL lets go; its items fail now.
            self.give_up(group, cause="read_error")
            return
        self.running.remove(group)
        if not group.answered:  # over before its claim's answer: wait for it
            group.ended, group.ended_at = state, self._clock()
            for item in group.items:
                item.move(Stage.CONFIRMING)
            self.awaiting.append(group)
        else:
            self._settle(group, state, self._clock())

    def confirm(self, group: ReadGroup, reply: Reply, held: dict[str, int]) -> None:
        """A claim's answer (`held`: per key, the lease that now holds it for this
        engine): an item's bytes are the entry's if the producer still pinned it under
        the lease it was claimed under, at the very spans read; the others are refused.
        Every lease the answer holds an item under is given back after the READ."""
        answers = {key: (status, spans) for key, status, spans in reply.results}
        for key, lease in group.claims.items():
            status, spans = answers.get(key, (LAPSED, []))
            holder = held.get(key, 0) if status == OK else 0
            if holder:
                group.granted[key] = holder
            if holder != lease or list(map(tuple, spans)) != list(map(tuple, group.spans[key])):
                group.refused.add(key)
        group.answered = True
        group.lease_until = group.claim_sent + reply.lease_s - LEASE_MARGIN_S
        for item in group.items:
            item.heard.add(group.peer)
        if group in self.awaiting:
            self.awaiting.remove(group)
            self._settle(group, group.ended or "ERR", group.ended_at)

    def lapse(self, group: ReadGroup) -> None:
        """A handle READ whose claim can confirm nothing (it could not be sent, or the
        producer is incompatible): its items are asked again once NIXL lets go of it
        (its blocks may still be written until then)."""
        group.answered = True
        group.refused.update(group.claims)
        if group in self.awaiting:
            self.awaiting.remove(group)
            self._settle(group, group.ended or "ERR", group.ended_at)

    def _claim_unanswered(self, group: ReadGroup) -> None:
        """A handle READ that is over, whose claim got no answer in time."""
        self.awaiting.remove(group)
        self._local.abandon_many([item.wanted.key for item in group.items])
        self._forget_claim(group.claim_nonce)
        self._links.down(group.peer, "no answer to a claim in time")
        for item in group.items:
            self._deadlines.finish(item, "unreachable")

    def _settle(self, group: ReadGroup, state: str, ended_at: float) -> None:
        """A READ that is over, its claim (if any) answered: its trusted items land (or
        fail), its refused ones are asked again (their blocks freed first); then its
        pins go back."""
        good = state == "DONE" and ended_at <= group.lease_until
        trusted = [item for item in group.items if item.wanted.key not in group.refused]
        refused = [item for item in group.items if item.wanted.key in group.refused]
        keys = [item.wanted.key for item in trusted]
        landed = self._local.landed_many(keys) if good and keys else [False] * len(keys)
        failed = [key for key, ok in zip(keys, landed, strict=True) if not ok]
        failed.extend(item.wanted.key for item in refused)
        if failed:
            self._local.abandon_many(failed)
        counters = self._counters
        for item, ok in zip(trusted, landed, strict=True):
            if ok:
                counters.remote_hits += 1
                counters.bytes_fetched += self._shapes.nbytes(item.wanted)
                counters.fetch_seconds += ended_at - group.started
                self._deadlines.finish(item, "landed")
            else:
                self._deadlines.finish(item, "read_error")
        now = self._clock()
        for item in refused:
            item.move(Stage.LOOKING_UP)
            task = self._deadlines.task_of(item)
            if task is not None and now < task.lookup_deadline:
                self._asks.again(task, item)
            else:
                item.answers[group.peer] = "unreachable"
        self._releases.after_read(group.peer, group.granted, read=state == "DONE")

    # ------------------------------------------------------------- ending

    def give_up(self, group: ReadGroup, cause: str | None = None) -> None:
        """A READ past its deadline (or a handle READ whose claim got no answer in
        time, or one that failed with `cause`): its items fail; its blocks are freed
        only once NIXL lets go of it (else quarantined)."""
        self.running.remove(group)
        if not group.answered:
            self._forget_claim(group.claim_nonce)
            if cause is None:
                cause = "unreachable"
                self._links.down(group.peer, "no answer to a claim in time")
        cause = cause or "timeout"
        for item in group.items:
            if not item.decided:
                self._deadlines.finish(item, cause)
        self._quarantine.end(group)

    def end_all(self) -> None:
        """The fetcher stops: give up every READ; free the blocks of those over (their
        items fail with their tasks)."""
        for group in list(self.running):
            self.give_up(group)
        for group in list(self.awaiting):
            self.awaiting.remove(group)
            self._quarantine.free(group)
