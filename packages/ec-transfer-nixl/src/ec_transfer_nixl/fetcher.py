"""Fetcher: a consumer fetches the items a request lacks from its peers, in a thread of its own.

Runs in the scheduler process. The scheduler thread stages one FetchTask
per request (`submit`), hands a step's tasks over together at its end
(`kick`), and reads only `task.done`; everything else happens here. Each
pass of the thread asks every peer, in one Lookup, for all the items that
the tasks handed over since the last pass want from it (the requests of one
engine step therefore cost one round trip per peer), and
reads all the items one Reply leased with one NIXL READ (a ReadGroup), into
local blocks reserved as not-ready entries.

A task may carry a request-level handle's pre-granted lease (`HandleLease`):
the producer pinned those entries when it made the handle, and the handle
names their spans, signed. The handle tasks of one pass are claimed together:
per producer, one *claim* (a Lookup naming each item's lease) for all their
items and, if this engine knows the producer's NIXL agent already, one READ of
all of them, started before the claim goes out (the claim's round trip then
overlaps the READ). The bytes of an item count only once the producer
confirms that its lease still pinned those very spans (then they were pinned
from the handle's making to the Release, so they are the entry's). An item
whose claim lapsed (or whose spans moved) is thrown away once the READ is
over and looked up again; the others land. Without the agent, the claim goes
out first and the READ follows its answer (one round trip, as a lookup).

Every path ends in one of two outcomes per item: *landed* (the entry is ready
in this engine's region and the workers load it like any other) or *failed*
with a cause (the request then encodes it). INVARIANT: a reservation whose
READ may still write is never freed — a READ past its deadline that NIXL
will not release stays in `_quarantine`, its blocks reserved (not ready,
never loaded), until NIXL reports it finished; only then are they freed.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import queue
import socket as pysocket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from ec_core._vllm import get_logger
from ec_core.peer_settings import LEASE_MARGIN_S
from ec_core.ratelimit import RateLimitedWarnings
from ec_scheduler.remote import ANY_WIDTH
from ec_transfer_nixl.agent import RegionAgent, Span, paired_spans
from ec_transfer_nixl.counters import PeerCounters
from ec_transfer_nixl.leases import keys_by_lease
from ec_transfer_nixl.sockets import peer_socket
from ec_transfer_nixl.wire import (
    INCOMPATIBLE,
    LAPSED,
    OK,
    SAVING,
    SHAPE,
    Lookup,
    Release,
    Reply,
    WireError,
    open_frame,
    seal,
)

if TYPE_CHECKING:
    from ec_core.peer_settings import PeerAddress
    from ec_scheduler.remote import LocalEntries, Wanted

logger = get_logger(__name__)

IDLE_POLL_MS = 50
WAITING_POLL_MS = 1
"""While lookups are out: a reply wakes the poll at once anyway."""
READING_PAUSE_S = 0.00005
"""While READs run: NIXL progresses them when their state is checked, so check often."""
SAVING_RETRY_S = 0.01
"""How soon a peer that is still saving an item is asked again."""
CONNECT_RETRY_S = 0.005
"""How soon a lookup is sent again to a peer whose connection is not up yet."""
DOWN_FOR_S = 5.0
"""How long a peer that did not answer is not asked."""
CAUSE_ORDER = ("incompatible", "shape", "read_error", "not_ready", "missing")
LINKS_MAX = 256
"""Links kept to peers; beyond it, those no open fetch uses are dropped (handles,
client input, may name any number of producers; ZeroMQ allows 1023 sockets)."""
LATE_REPLY_S = 5.0
"""A link asked this recently is not dropped as idle: a reply that comes after its
fetch was given up is still read, and its leases released (a closed socket would
leave them pinned at the producer until they expire)."""
LOOKUP_ITEMS_MAX = 256
"""Items per Lookup message; more are asked in several (the producer answers each
under its scheduler's lock, so one message must not hold it long)."""


@dataclass(frozen=True, eq=False)
class HandleLease:
    """A request-level handle's pre-granted lease (its signature checked already)."""

    peer: PeerAddress
    lease: int
    agent: str
    """The producer's NIXL agent the spans belong to."""
    spans: dict[str, list[tuple[int, int]]]
    """Per leased key, where its bytes lie in the producer's region."""
    shapes: dict[str, tuple[int, int]]


@dataclass(eq=False)
class ItemFetch:
    """One item of a task: which peers were asked, and what came of it."""

    wanted: Wanted
    answers: dict[PeerAddress, str] = field(default_factory=dict)
    retry_at: dict[PeerAddress, float] = field(default_factory=dict)
    heard: set[PeerAddress] = field(default_factory=set)
    """Peers that answered for this item at least once (they are up)."""
    asked: set[PeerAddress] = field(default_factory=set)
    """Peers a lookup (or claim) for this item went to."""
    reading: ReadGroup | None = None
    outcome: str | None = None
    """"landed" or a failure cause; None while undecided."""


@dataclass(eq=False)
class FetchTask:
    """The fetches one request waits for. `done` is the only field the scheduler reads."""

    request_id: str
    items: dict[str, ItemFetch]
    candidates: tuple[PeerAddress, ...]
    lookup_deadline: float
    deadline: float
    done: bool = False
    handle: HandleLease | None = None
    features: int = 0
    """How many multimodal items the request had when it was asked (a streaming-input
    session's later chunks add more)."""


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


@dataclass
class _Link:
    """The DEALER socket to one peer and what this engine knows of the peer."""

    socket: zmq.Socket[Any] | None
    """None: ZeroMQ refused a socket for the peer (it is down until `down_until`)."""
    down_until: float = 0.0
    incompatible: bool = False
    agent: str = ""
    """The peer's NIXL agent this engine knows (its metadata was added)."""
    asked_at: float = -math.inf
    """When a lookup was last sent on it (the fetcher's clock)."""


class Fetcher:
    """The consumer side (see the module docstring)."""

    def __init__(
        self,
        *,
        context: zmq.Context[Any],
        secret: bytes,
        fingerprint: str,
        local: LocalEntries,
        make_agent: Callable[[], RegionAgent],
        spans: Callable[[tuple[tuple[int, int], ...], int], list[Span]],
        itemsize: int,
        counters: PeerCounters,
        on_failed: Callable[[str, str], None],
        embed_width: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`embed_width`: this engine's LM embedding width, which every encoder output
        width a peer offers for an item asked with any width must be a multiple of
        (`Wanted.accepts`)."""
        self._context = context
        self._embed_width = embed_width
        self._secret = secret
        self._fingerprint = fingerprint
        self._local = local
        self._make_agent = make_agent
        self._spans = spans
        self._itemsize = itemsize
        self.counters = counters
        self._on_failed = on_failed
        self._clock = clock
        self._inbox: queue.SimpleQueue[list[FetchTask]] = queue.SimpleQueue()
        """Batches handed over by `kick` (each: one step's tasks)."""
        self._staged: list[FetchTask] = []
        """Tasks submitted since the last `kick` (guarded by `_staging`)."""
        self._staged_at = 0.0
        """When the oldest of them was submitted (the fetcher's clock)."""
        self._staging = threading.Lock()
        self._wake_r, self._wake_w = pysocket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._links: dict[PeerAddress, _Link] = {}
        self._poller: zmq.Poller | None = None
        self._pending: dict[
            int, tuple[PeerAddress, dict[str, tuple[FetchTask, ItemFetch]], float]
        ] = {}
        """Lookup nonce -> the peer asked, the items it was asked for, and when it was
        sent (a lease it grants cannot have begun before)."""
        self._claims: dict[int, ReadGroup] = {}
        """Claim nonce -> the READ started on the handle leases it claims (if one was)."""
        self._claiming: dict[PeerAddress, list[tuple[FetchTask, list[ItemFetch]]]] = {}
        """Per producer, the handle tasks taken on in this pass and their items its
        leases cover: claimed together once the pass has taken on its tasks."""
        self._asks: dict[PeerAddress, dict[str, tuple[FetchTask, ItemFetch]]] = {}
        """Items to ask each peer for at the end of this pass."""
        self._releases: list[tuple[PeerAddress, dict[int, list[str]], bool]] = []
        """Releases to send at the end of this pass (after the tasks they ended are done)."""
        self._tasks: list[FetchTask] = []
        self._reads: list[ReadGroup] = []
        self._awaiting: list[ReadGroup] = []
        """Handle READs that are over, waiting for their claim's answer."""
        self._quarantine: list[ReadGroup] = []
        self._nonces = itertools.count(1)
        self.handle_reads = 0
        """Items READ on a handle's lease before any answer (for tests and benchmarks)."""
        self.handle_batches = 0
        """NIXL READs those were read with (one per producer and pass)."""
        self._warnings = RateLimitedWarnings(logger)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ec-cpu-peer-fetcher", daemon=True)

    # ------------------------------------------------ the scheduler thread

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    @property
    def running(self) -> bool:
        """Whether the thread still takes tasks on (False once it stopped, asked to or not)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, task: FetchTask) -> None:
        """Stage a task for the fetcher thread (never blocks).

        Guarantee: the thread takes on the tasks staged between two `kick`s
        together, in one pass (one Lookup per peer, one claim and one READ per
        producer for their handles), however busy it is meanwhile; only tasks
        staged more than IDLE_POLL_MS ago with no `kick` (a caller that never
        kicks) are taken on without one. Waking the thread here would hand it
        the GIL at the first of a step's tasks, and it would ask for them one
        by one."""
        with self._staging:
            if not self._staged:
                self._staged_at = self._clock()
            self._staged.append(task)

    def kick(self) -> None:
        """Hand the staged tasks over as one batch and wake the thread (never blocks)."""
        if self._stop.is_set():
            return  # what is staged fails at the thread's end
        with self._staging:
            batch, self._staged = self._staged, []
        if not batch:
            return
        self._inbox.put(batch)
        # A full pipe: the thread is awake anyway; a closed one: it has stopped.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _take_tasks(self, *, all_staged: bool = False) -> list[FetchTask]:
        """The tasks to take on in this pass: every batch `kick` handed over, and the
        staged tasks no `kick` came for within IDLE_POLL_MS (every staged one with
        `all_staged`)."""
        tasks: list[FetchTask] = []
        while True:
            try:
                tasks.extend(self._inbox.get_nowait())
            except queue.Empty:
                break
        if self._staged and (all_staged or self._clock() - self._staged_at >= IDLE_POLL_MS / 1000):
            with self._staging:
                tasks.extend(self._staged)
                self._staged = []
        return tasks

    def stop(self) -> bool:
        """Stop the thread (open fetches fail, reads are released or quarantined);
        False if it did not end in time."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        stopped = not self._thread.is_alive()
        if stopped:
            self._wake_r.close()
            self._wake_w.close()
        return stopped

    @property
    def quarantined(self) -> int:
        """READs past their deadline that NIXL has not finished yet (blocks held)."""
        return len(self._quarantine)

    # ---------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            self.agent = self._make_agent()
        except BaseException as exc:
            self._error = RuntimeError(f"EC CPU tier: cannot start the peer fetcher: {exc}")
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                self._loop_once()
        except Exception:
            # A bug, not a peer's doing (those are handled where they happen). The open
            # fetches fail below, and `running` turns False: every item from now on is
            # encoded locally, and no request waits on a thread that is gone.
            logger.exception("EC CPU tier: the peer fetcher stopped on an unexpected error")
        finally:
            self._shutdown()

    def _loop_once(self) -> None:
        poller = self._poller
        if poller is None:  # built again only when a link is added
            poller = self._poller = zmq.Poller()
            poller.register(self._wake_r, zmq.POLLIN)
            for link in self._links.values():
                if link.socket is not None:
                    poller.register(link.socket, zmq.POLLIN)
        if self._reads or self._quarantine:
            events = dict(poller.poll(0))
            if not events:
                time.sleep(READING_PAUSE_S)
        else:
            busy = self._tasks or self._awaiting
            events = dict(poller.poll(WAITING_POLL_MS if busy else IDLE_POLL_MS))
        if self._wake_r.fileno() in events:
            with contextlib.suppress(BlockingIOError):
                while self._wake_r.recv(4096):
                    pass
        for task in self._take_tasks():
            self._begin(task)
        self._flush_claims()  # before the replies are read: their READs start first
        for link in list(self._links.values()):
            if link.socket is not None and link.socket in events:
                self._receive(link)
        self._tick(self._clock())

    def _tick(self, now: float) -> None:
        """One pass over everything open: claims and READs, lookups to send, deadlines,
        quarantine."""
        self._flush_claims()
        for group in list(self._reads):
            if now > group.deadline or (not group.answered and now > group.claim_deadline):
                self._give_up(group)
            else:
                self._poll_read(group)
        for group in list(self._awaiting):
            if now > group.claim_deadline:
                self._claim_unanswered(group)
        self._flush_asks()
        for task in list(self._tasks):
            self._progress(task, now)
        self._flush_asks()
        self._drain_quarantine()
        self._flush_releases()

    # ----------------------------------------------------------- lookups

    def _link(self, peer: PeerAddress) -> _Link:
        link = self._links.get(peer)
        if link is None or (link.socket is None and link.down_until <= self._clock()):
            if link is None and len(self._links) >= LINKS_MAX:
                self._drop_idle_links()
            sock = None
            try:
                sock = peer_socket(self._context, zmq.DEALER, peer)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a peer not connected
                sock.connect(peer.endpoint)
                link = _Link(sock)
            except zmq.ZMQError as exc:  # e.g. an address it cannot parse, or no sockets left
                if sock is not None:
                    sock.close(0)
                # One tag for all such peers: a handle may name any number of them.
                self._warnings.warn("link", "EC CPU tier: cannot connect to %s: %s", peer, exc)
                link = _Link(None, down_until=self._clock() + DOWN_FOR_S)
            self._links[peer] = link
            self._poller = None
        return link

    def _drop_idle_links(self) -> None:
        """Close the links no open fetch, READ or message to send uses, and that were
        not asked in the last LATE_REPLY_S (they are kept while the number of links is
        past LINKS_MAX: only a peer that accepted a connection is ever asked)."""
        late = self._clock() - LATE_REPLY_S
        busy = {peer for peer, link in self._links.items() if link.asked_at > late}
        busy.update(peer for peer, _, _ in self._pending.values())
        busy.update(g.peer for g in (*self._reads, *self._awaiting, *self._quarantine))
        busy.update(self._asks)
        busy.update(self._claiming)
        busy.update(peer for peer, _, _ in self._releases)
        for task in self._tasks:
            busy.update(task.candidates)
            if task.handle is not None:
                busy.add(task.handle.peer)
        dropped: set[str] = set()
        for peer in [peer for peer in self._links if peer not in busy]:
            link = self._links.pop(peer)
            if link.socket is not None:
                link.socket.close(0)
            if link.agent:
                dropped.add(link.agent)
        # A producer reached under two addresses (a handle's and an `ec_peers` entry)
        # has one agent for both links: it is forgotten only with its last link.
        for agent in dropped - {link.agent for link in self._links.values()}:
            self.agent.forget(agent)
        self._poller = None

    def _begin(self, task: FetchTask) -> None:
        """Take a task on; its lookups go out at the end of this pass, the claim of its
        handle's lease (with those of the pass's other handles) at its start."""
        self._tasks.append(task)
        self.counters.remote_lookups += len(task.items)
        claimed = self._claimable(task) if task.handle is not None else []
        if claimed:
            assert task.handle is not None
            self._claiming.setdefault(task.handle.peer, []).append((task, claimed))
        taken = {item.wanted.key for item in claimed}
        for peer in task.candidates:
            for key, item in task.items.items():
                if key not in taken:
                    self._queue_ask(peer, task, item)

    def _queue_ask(self, peer: PeerAddress, task: FetchTask, item: ItemFetch) -> None:
        self._asks.setdefault(peer, {})[item.wanted.key] = (task, item)

    def _flush_asks(self) -> None:
        asks, self._asks = self._asks, {}
        for peer, wanted in asks.items():
            entries = [(k, v) for k, v in wanted.items() if v[1].outcome is None]
            for first in range(0, len(entries), LOOKUP_ITEMS_MAX):
                self._ask(peer, dict(entries[first : first + LOOKUP_ITEMS_MAX]))

    def _ask(
        self,
        peer: PeerAddress,
        wanted: dict[str, tuple[FetchTask, ItemFetch]],
        *,
        claims: dict[str, int] | None = None,
        group: ReadGroup | None = None,
    ) -> bool:
        """Send one Lookup to `peer` for `wanted` (key -> its task and item); with
        `claims` (key -> handle lease), the claim of those leases (and `group`, the
        READ started on them). False if it could not be sent."""
        link = self._link(peer)
        now = self._clock()
        if link.incompatible or link.down_until > now:
            answer = "incompatible" if link.incompatible else "unreachable"
            for _, item in wanted.values():
                item.answers[peer] = answer
                item.retry_at.pop(peer, None)
            return False
        nonce = next(self._nonces)
        under = [claims[key] for key in wanted] if claims else []
        lookup = Lookup(
            nonce=nonce,
            sent_at=time.time(),
            fingerprint=self._fingerprint,
            items=[(i.wanted.key, i.wanted.rows, i.wanted.cols) for _, i in wanted.values()],
            known_agent=link.agent,
            claims=under,
        )
        try:
            assert link.socket is not None  # a link without one is down
            link.socket.send(seal(lookup, self._secret), zmq.NOBLOCK)
        except zmq.Again:
            # Not connected (yet): IMMEDIATE queues nothing for it. Try again soon;
            # at the lookup deadline it counts as unreachable.
            for _, item in wanted.values():
                item.retry_at[peer] = now + CONNECT_RETRY_S
            return False
        self._pending[nonce] = (peer, wanted, now)
        link.asked_at = now
        if group is not None:
            group.claim_sent, group.claim_nonce = now, nonce
            self._claims[nonce] = group
        for _, item in wanted.values():
            item.asked.add(peer)
            item.retry_at.pop(peer, None)
            item.answers.pop(peer, None)  # asked (again): its answer is awaited
        return True

    def _claimable(self, task: FetchTask) -> list[ItemFetch]:
        """The task's items its handle's lease covers, as asked (shape and size), if
        its producer may be asked now."""
        handle = task.handle
        assert handle is not None
        link = self._link(handle.peer)
        if link.incompatible or link.down_until > self._clock():
            return []
        claimable: list[ItemFetch] = []
        for key, item in task.items.items():
            shape = handle.shapes.get(key)
            if key not in handle.spans or shape is None:
                continue
            if self._takes(handle.peer, item, shape) and _holds(
                handle.spans[key], self._nbytes(item.wanted)
            ):
                claimable.append(item)
        return claimable

    def _takes(self, peer: PeerAddress, item: ItemFetch, offered: tuple[int, int] | None) -> bool:
        """Whether `item` may be read as the shape `peer` holds it in (`offered`; None from
        a producer that does not say), fixing the item's width from it; a refusal is
        said in a rate-limited warning. The peer is compatible (same fingerprint), so an
        offered width that `Wanted.accepts` is the one this engine's model produces."""
        if offered is None:
            if item.wanted.cols != ANY_WIDTH:
                return True  # the producer answered OK for exactly the width asked
        elif item.wanted.accepts(offered, self._embed_width):
            item.wanted = item.wanted.with_cols(offered[1])
            return True
        self._refused_shape(peer, item.wanted, offered or (0, 0))
        return False

    def _refused_shape(self, peer: PeerAddress, wanted: Wanted, offered: tuple[int, int]) -> None:
        """Say why an item a peer holds is not fetched from it for its shape."""
        asked = "any width" if wanted.cols == ANY_WIDTH else f"width {wanted.cols}"
        self._warnings.warn(
            "shape",
            "EC CPU tier: peer %s holds item %s as %d x %d, but this engine needs %d rows "
            "(its placeholder's embeddings) of %s (a multiple of the embedding width %d); "
            "encoding it here. A reused multimodal UUID, or engines configured differently "
            "for one model, do this",
            peer,
            wanted.key,
            offered[0],
            offered[1],
            wanted.rows,
            asked,
            self._embed_width,
        )

    def _flush_claims(self) -> None:
        """Claim the handle leases of the tasks taken on since the last pass: per
        producer, one claim for all their items and, for those whose handle names the
        producer's agent this engine knows, one READ of them all, at once."""
        claiming, self._claiming = self._claiming, {}
        for peer, batch in claiming.items():
            link = self._link(peer)
            if link.incompatible or link.down_until > self._clock():
                for task, items in batch:  # it became so since: asked (and failed) as usual
                    for item in items:
                        self._ask_again(task, item)
                continue
            at_once: list[tuple[FetchTask, ItemFetch]] = []
            after: list[tuple[FetchTask, ItemFetch]] = []
            for task, items in batch:
                assert task.handle is not None
                known = bool(link.agent) and task.handle.agent == link.agent
                (at_once if known else after).extend((task, item) for item in items)
            for first in range(0, len(at_once), LOOKUP_ITEMS_MAX):
                self._read_and_claim(peer, at_once[first : first + LOOKUP_ITEMS_MAX])
            for first in range(0, len(after), LOOKUP_ITEMS_MAX):
                self._claim(peer, after[first : first + LOOKUP_ITEMS_MAX])

    def _claim(self, peer: PeerAddress, batch: list[tuple[FetchTask, ItemFetch]]) -> None:
        """Claim the handle leases of `batch` without a READ (no metadata for the
        producer's agent yet): their answer is read like a lookup's. Those that cannot
        be claimed are asked as usual."""
        wanted = {item.wanted.key: (task, item) for task, item in batch}
        if not self._ask(peer, wanted, claims=_leases_of(batch)):
            for task, item in batch:
                self._ask_again(task, item)

    def _read_and_claim(self, peer: PeerAddress, batch: list[tuple[FetchTask, ItemFetch]]) -> None:
        """Reserve blocks for `batch`, start one READ of all of it from the spans its
        handles name, then send their claim (one message for all their leases).

        The READ goes first: a send wakes ZeroMQ's threads and, through them, the
        producer's server thread, and on a busy host they take the CPU before a READ
        started after the send (measured on 2 cores: the fetcher thread got the CPU
        back ~0.3 ms after a send, and over UCX_TLS=tcp handle fetches were 1-11%
        slower in that order). Where the READ runs asynchronously (TCP, RDMA) the
        claim's round trip overlaps it all the same."""
        reserved, local_spans, _ = self._reserve([item for _, item in batch])
        if not reserved:
            return  # those without room failed: no_space
        task_of = {id(item): task for task, item in batch}
        tasks = [task_of[id(item)] for item in reserved]
        claims = _leases_of(batch)
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
            group.handle = self.agent.read(self._link(peer).agent, pieces)
        except Exception as exc:
            # Nothing enqueued: the blocks are free; claimed as by an engine that does
            # not know the agent (a READ after the answer).
            self._local.abandon_many(list(remote))
            self._warnings.warn("read", "EC CPU tier: a READ from %s failed: %s", peer, exc)
            self._claim(peer, [(task_of[id(item)], item) for item in reserved])
            return
        for item in reserved:
            item.reading = group
        self._reads.append(group)
        self.handle_reads += len(reserved)
        self.handle_batches += 1
        wanted = {item.wanted.key: (task_of[id(item)], item) for item in reserved}
        if not self._ask(peer, wanted, claims=group.claims, group=group):
            self._lapse(group)  # unconfirmed bytes: asked again once the READ is over
        self._poll_read(group)  # a small READ may be done already

    def _peer_down(self, peer: PeerAddress, why: str) -> None:
        link = self._links.get(peer)
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

    def _receive(self, link: _Link) -> None:
        sock = link.socket
        assert sock is not None  # only a link with a socket is polled
        # EVENTS is read without letting go of the GIL; a recv that finds nothing would
        # let go of it (and wait to take it back) only to raise.
        while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            frame = sock.recv(zmq.NOBLOCK)
            try:
                reply = open_frame(frame, self._secret)
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
            self._apply(link, reply)

    def _know(self, link: _Link, reply: Reply) -> str:
        """The name to READ from the reply's agent (its metadata added if new)."""
        if reply.agent != link.agent:
            if not reply.agent_metadata:
                raise RuntimeError(f"no metadata for the peer's NIXL agent {reply.agent}")
            if link.agent:
                self.agent.forget(link.agent)  # the peer restarted: a new agent
            self.agent.know(reply.agent, reply.agent_metadata)
            link.agent = reply.agent
        return link.agent

    def _apply(self, link: _Link, reply: Reply) -> None:
        waiting = self._pending.pop(reply.nonce, None)
        group = self._claims.pop(reply.nonce, None)
        held = dict(zip([key for key, _, _ in reply.results], reply.leases, strict=True))
        if waiting is None:  # an answer that came too late: give its leases back
            self._release(link, keys_by_lease(held, held))
            return
        peer, wanted, sent = waiting
        if reply.status == INCOMPATIBLE:
            if not link.incompatible:
                logger.warning(
                    "EC CPU tier: peer %s runs an incompatible engine (model, dtype, "
                    "embedding width, block size or wire version differ); it is not asked "
                    "again and its items are encoded here",
                    peer,
                )
            link.incompatible = True
            for _, item in wanted.values():
                item.answers[peer] = "incompatible"
            if group is not None:
                self._lapse(group)
            return
        if group is not None:
            self._confirm(group, reply, held)
        not_needed: list[str] = []
        to_read: list[tuple[FetchTask, ItemFetch, list[tuple[int, int]], int]] = []
        shapes = reply.shapes if len(reply.shapes) == len(reply.results) else None
        for at, (key, status, spans) in enumerate(reply.results):
            found = wanted.pop(key, None)  # each key is answered once per lookup
            if group is not None and key in group.claims:
                continue  # the READ started on its claimed lease: decided by _confirm
            if found is None or found[1].outcome is not None or found[1].reading is not None:
                not_needed.append(key)
                continue
            task, item = found
            item.heard.add(peer)
            offered = shapes[at] if shapes is not None else None
            if status == OK:
                if task.done:
                    not_needed.append(key)
                elif self._takes(peer, item, offered):
                    to_read.append((task, item, spans, held[key]))
                else:
                    item.answers[peer] = "shape"
                    not_needed.append(key)
            elif status == SAVING:
                item.answers[peer] = "not_ready"
                item.retry_at[peer] = self._clock() + SAVING_RETRY_S
            elif status == LAPSED:  # the handle's lease is gone: ask every peer now
                self._ask_again(task, item)
            elif status == SHAPE:
                item.answers[peer] = "shape"
                self._refused_shape(peer, item.wanted, offered or (0, 0))
            else:
                item.answers[peer] = "missing"
        if to_read:
            not_needed.extend(self._start_read(peer, link, reply, to_read, sent))
        self._release(link, keys_by_lease(held, not_needed))

    def _ask_again(self, task: FetchTask, item: ItemFetch) -> None:
        for peer in task.candidates:
            item.answers.pop(peer, None)
            self._queue_ask(peer, task, item)

    def _release(self, link: _Link, leases: dict[int, list[str]], *, read: bool = False) -> None:
        """Give back the keys of each lease (one message for all of them)."""
        if not leases or link.socket is None:
            return
        release = Release(
            nonce=next(self._nonces), sent_at=time.time(), leases=list(leases.items()), read=read
        )
        with contextlib.suppress(zmq.Again):  # else the producer's lease expires by itself
            link.socket.send(seal(release, self._secret), zmq.NOBLOCK)

    def _flush_releases(self) -> None:
        releases, self._releases = self._releases, []
        for peer, leases, read in releases:
            link = self._links.get(peer)
            if link is not None:
                self._release(link, leases, read=read)

    # -------------------------------------------------------------- reads

    def _nbytes(self, wanted: Wanted) -> int:
        return wanted.rows * wanted.cols * self._itemsize

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
                self._finish(item, "no_space")
                full.append(item)
            else:
                reserved.append(item)
                spans.append(tuple(self._spans(got, self._nbytes(item.wanted))))
        return reserved, spans, full

    def _start_read(
        self,
        peer: PeerAddress,
        link: _Link,
        reply: Reply,
        leased: list[tuple[FetchTask, ItemFetch, list[tuple[int, int]], int]],
        sent: float,
    ) -> list[str]:
        """Reserve blocks for the leased items (`(task, item, spans, lease)`) and start
        one READ of them all; the keys not being read (their pins can go back at once).
        `sent`: when the lookup went out (the lease began no earlier)."""
        not_read: list[str] = []
        fitting: list[tuple[FetchTask, ItemFetch, list[tuple[int, int]], int]] = []
        for task, item, remote, lease in leased:
            if not _holds(remote, self._nbytes(item.wanted)):
                # Spans that do not add up to the item's bytes: a broken peer, never
                # read (a READ of them would write past the item's blocks here).
                item.answers[peer] = "shape"
                self._warnings.warn(
                    "spans",
                    "EC CPU tier: peer %s offered item %s in spans of %d bytes, not the "
                    "%d its shape takes; encoding it here",
                    peer,
                    item.wanted.key,
                    sum(n for _, n in remote),
                    self._nbytes(item.wanted),
                )
                not_read.append(item.wanted.key)
            else:
                fitting.append((task, item, remote, lease))
        reserved, local_spans, full = self._reserve([item for _, item, _, _ in fitting])
        not_read.extend(item.wanted.key for item in full)
        if not reserved:
            return not_read
        of = {id(item): (task, remote, lease) for task, item, remote, lease in fitting}
        pieces: list[tuple[Span, Span]] = []
        for item, here in zip(reserved, local_spans, strict=True):
            pieces.extend(paired_spans(here, of[id(item)][1]))
        try:
            agent = self._know(link, reply)
            # No NIXL notification: the READ then completes here without waiting for
            # the producer to poll; the Release sent when it is over unpins the entries.
            handle = self.agent.read(agent, pieces)
        except Exception as exc:
            # Nothing was enqueued (or NIXL refused it at once): the blocks are free.
            self._local.abandon_many([item.wanted.key for item in reserved])
            for item in reserved:
                item.answers[peer] = "read_error"
                not_read.append(item.wanted.key)
            self._warnings.warn("read", "EC CPU tier: a READ from %s failed: %s", peer, exc)
            return not_read
        now = self._clock()
        group = ReadGroup(
            handle=handle,
            peer=peer,
            items=reserved,
            started=now,
            lease_until=sent + reply.lease_s - LEASE_MARGIN_S,
            deadline=min(of[id(item)][0].deadline for item in reserved),
            granted={item.wanted.key: of[id(item)][2] for item in reserved},
        )
        for item in reserved:
            item.reading = group
        self._reads.append(group)
        self._poll_read(group)  # a small READ may be done already
        return not_read

    def _confirm(self, group: ReadGroup, reply: Reply, held: dict[str, int]) -> None:
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
        if group in self._awaiting:
            self._awaiting.remove(group)
            self._settle(group, group.ended or "ERR", group.ended_at)

    def _lapse(self, group: ReadGroup) -> None:
        """A handle READ whose claim can confirm nothing (it could not be sent, or the
        producer is incompatible): its items are asked again once NIXL lets go of it
        (its blocks may still be written until then)."""
        group.answered = True
        group.refused.update(group.claims)
        if group in self._awaiting:
            self._awaiting.remove(group)
            self._settle(group, group.ended or "ERR", group.ended_at)

    def _claim_unanswered(self, group: ReadGroup) -> None:
        """A handle READ that is over, whose claim got no answer in time."""
        self._awaiting.remove(group)
        self._local.abandon_many([item.wanted.key for item in group.items])
        self._forget_claim(group)
        self._peer_down(group.peer, "no answer to a claim in time")
        for item in group.items:
            item.reading = None
            self._finish(item, "unreachable")

    def _forget_claim(self, group: ReadGroup) -> None:
        """Stop waiting for a claim's answer: if it comes, it is a late answer, and
        releases what it leased (see _apply)."""
        self._claims.pop(group.claim_nonce, None)
        self._pending.pop(group.claim_nonce, None)

    def _task_of(self, item: ItemFetch) -> FetchTask | None:
        for task in self._tasks:
            if task.items.get(item.wanted.key) is item:
                return task
        return None

    def _poll_read(self, group: ReadGroup) -> None:
        state = self.agent.state(group.handle)
        if state == "PROC":
            return
        if not self.agent.release(group.handle) and state != "DONE":
            # Failed, yet NIXL keeps the transfer: it may still write the blocks, so
            # they stay reserved (quarantined) until NIXL lets go; its items fail now.
            self._give_up(group, cause="read_error")
            return
        self._reads.remove(group)
        if not group.answered:  # over before its claim's answer: wait for it
            group.ended, group.ended_at = state, self._clock()
            self._awaiting.append(group)
        else:
            self._settle(group, state, self._clock())

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
        for item, ok in zip(trusted, landed, strict=True):
            item.reading = None
            if ok:
                self.counters.remote_hits += 1
                self.counters.bytes_fetched += self._nbytes(item.wanted)
                self.counters.fetch_seconds += ended_at - group.started
                self._finish(item, "landed")
            else:
                self._finish(item, "read_error")
        now = self._clock()
        for item in refused:
            item.reading = None
            task = self._task_of(item)
            if task is not None and now < task.lookup_deadline:
                self._ask_again(task, item)
            else:
                item.answers[group.peer] = "unreachable"
        self._read_over(group, read=state == "DONE")

    # --------------------------------------------------------- deadlines

    def _progress(self, task: FetchTask, now: float) -> None:
        for item in task.items.values():
            if item.outcome is not None or item.reading is not None:
                continue
            for peer, when in list(item.retry_at.items()):
                if when <= now < task.lookup_deadline:
                    self._queue_ask(peer, task, item)  # still in retry_at: not decided
            self._decide(task, item, now)
        if all(item.outcome is not None for item in task.items.values()):
            task.done = True
            self._tasks.remove(task)
            for nonce, (_, wanted, _) in list(self._pending.items()):
                for key in task.items:
                    wanted.pop(key, None)
                if not wanted:
                    del self._pending[nonce]  # late answers release their leases
                    self._claims.pop(nonce, None)

    def _decide(self, task: FetchTask, item: ItemFetch, now: float) -> None:
        """Fail an item no peer can still provide; after the lookup deadline, mark the
        peers that never answered down."""
        waiting = [p for p in task.candidates if p not in item.answers or p in item.retry_at]
        if waiting and now < task.lookup_deadline:
            return
        for peer in waiting:
            tried = peer in item.asked or peer in item.retry_at  # not: a claim's other peers
            if peer in item.heard and item.answers.get(peer) is None:
                item.answers[peer] = "not_ready"  # it answered "saving" until the deadline
            elif peer not in item.answers:
                item.answers[peer] = "unreachable"
                if tried:
                    self._peer_down(
                        peer, "no answer in time (wrong ec_peer_secret, stopped, or overloaded)"
                    )
        causes = set(item.answers.values())
        cause = next((c for c in CAUSE_ORDER if c in causes), None)
        self._finish(item, cause or "unreachable")

    def _give_up(self, group: ReadGroup, cause: str | None = None) -> None:
        """A READ past its deadline (or a handle READ whose claim got no answer in
        time, or one that failed with `cause`): its items fail; its blocks are freed
        only once NIXL lets go of it (else quarantined)."""
        self._reads.remove(group)
        if not group.answered:
            self._forget_claim(group)
            if cause is None:
                cause = "unreachable"
                self._peer_down(group.peer, "no answer to a claim in time")
        cause = cause or "timeout"
        for item in group.items:
            item.reading = None
            if item.outcome is None:
                self._finish(item, cause)
        if self.agent.release(group.handle):
            self._free(group)
        else:
            self._quarantine.append(group)

    def _drain_quarantine(self) -> None:
        still = []
        for group in self._quarantine:
            if self.agent.state(group.handle) == "PROC" or not self.agent.release(group.handle):
                still.append(group)
            else:
                self._free(group)
        self._quarantine = still

    def _free(self, group: ReadGroup) -> None:
        """A READ that will write no more and whose items failed: free their blocks."""
        self._local.abandon_many([item.wanted.key for item in group.items])
        self._read_over(group, read=False)

    def _read_over(self, group: ReadGroup, *, read: bool) -> None:
        """The group's READ will touch the peer's memory no more: give the pins back
        (at the end of this pass, once the tasks it ended are marked done)."""
        if group.granted:
            self._releases.append((group.peer, keys_by_lease(group.granted, group.granted), read))

    def _finish(self, item: ItemFetch, outcome: str) -> None:
        item.outcome = outcome
        if outcome != "landed":
            self.counters.fell_back(outcome)
            self._on_failed(item.wanted.key, outcome)

    def _shutdown(self) -> None:
        try:
            # Tasks handed over or staged but never taken on fail with the open ones.
            self._tasks.extend(self._take_tasks(all_staged=True))
            for group in list(self._reads):
                self._give_up(group)
            for group in list(self._awaiting):
                self._awaiting.remove(group)
                self._free(group)
                for item in group.items:
                    item.reading = None
            for task in self._tasks:
                for item in task.items.values():
                    if item.outcome is None:
                        self._finish(item, "timeout")
                task.done = True
            self._tasks.clear()
            self._flush_releases()
        finally:
            # Whatever failed above: a socket left open would hang the context's
            # term(), and with it the engine's shutdown.
            for link in self._links.values():
                if link.socket is not None:
                    link.socket.close(0)
            self.agent.close()


def _holds(spans: list[tuple[int, int]], nbytes: int) -> bool:
    """`spans` (a peer's) are `nbytes` in all, each of a positive length at a valid
    address: a negative length would shift the READ's local side out of its blocks."""
    return all(a >= 0 and n > 0 for a, n in spans) and sum(n for _, n in spans) == nbytes


def _leases_of(batch: list[tuple[FetchTask, ItemFetch]]) -> dict[str, int]:
    """Per item of `batch`, the handle lease it is claimed under."""
    return {item.wanted.key: task.handle.lease for task, item in batch if task.handle is not None}
