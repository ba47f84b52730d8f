"""Fetcher: a consumer fetches the items a request lacks from its peers, in a thread of its own.

Runs in the scheduler process. The scheduler thread hands it one FetchTask
per request (`submit`) and reads only `task.done`; everything else happens
here: one Lookup per peer for all the request's items, a reservation of local
blocks and a NIXL READ per leased item, and the bookkeeping of deadlines.

Every path ends in one of two outcomes per item: *landed* (the entry is ready
in this engine's region and the workers load it like any other) or *failed*
with a cause (the request then encodes it). INVARIANT: a reservation whose
READ may still write is never freed — a READ past the fetch deadline that
NIXL will not release stays in `_quarantine`, its blocks reserved (not ready,
never loaded), until NIXL reports it finished; only then are they freed.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import socket as pysocket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from ec_core._vllm import get_logger
from ec_core.ratelimit import RateLimitedWarnings
from ec_transfer_nixl.agent import RegionAgent, Span, paired_spans
from ec_transfer_nixl.counters import PeerCounters
from ec_transfer_nixl.wire import (
    INCOMPATIBLE,
    MISSING,
    OK,
    SAVING,
    SHAPE,
    Lookup,
    Release,
    Reply,
    WireError,
    open_frames,
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
LEASE_MARGIN_S = 1.0
"""A READ that ends later than this before its lease's end is not trusted."""
CAUSE_ORDER = ("incompatible", "shape", "not_ready", "missing")


@dataclass(eq=False)
class ItemFetch:
    """One item of a task: which peers were asked, and what came of it."""

    wanted: Wanted
    asked: set[PeerAddress] = field(default_factory=set)
    answers: dict[PeerAddress, str] = field(default_factory=dict)
    retry_at: dict[PeerAddress, float] = field(default_factory=dict)
    heard: set[PeerAddress] = field(default_factory=set)
    """Peers that answered for this item at least once (they are up)."""
    reading: Any = None
    peer: PeerAddress | None = None
    lease: int = 0
    lease_until: float = 0.0
    read_started: float = 0.0
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


@dataclass
class _Link:
    """The DEALER socket to one peer and what this engine knows of the peer."""

    socket: zmq.Socket[Any]
    down_until: float = 0.0
    incompatible: bool = False


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._context = context
        self._secret = secret
        self._fingerprint = fingerprint
        self._local = local
        self._make_agent = make_agent
        self._spans = spans
        self._itemsize = itemsize
        self.counters = counters
        self._on_failed = on_failed
        self._clock = clock
        self._inbox: queue.SimpleQueue[FetchTask] = queue.SimpleQueue()
        self._wake_r, self._wake_w = pysocket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._links: dict[PeerAddress, _Link] = {}
        self._pending: dict[int, tuple[PeerAddress, FetchTask]] = {}
        self._tasks: list[FetchTask] = []
        self._quarantine: list[tuple[Any, str, PeerAddress | None, int]] = []
        self._nonces = itertools.count(1)
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

    def submit(self, task: FetchTask) -> None:
        """Hand a task to the fetcher thread (never blocks)."""
        self._inbox.put(task)
        with contextlib.suppress(BlockingIOError):  # a full pipe: the thread is awake anyway
            self._wake_w.send(b"x")

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
        finally:
            self._shutdown()

    def _loop_once(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for link in self._links.values():
            poller.register(link.socket, zmq.POLLIN)
        reading = bool(self._quarantine) or any(
            item.reading is not None for task in self._tasks for item in task.items.values()
        )
        if reading:
            events = dict(poller.poll(0))
            if not events:
                time.sleep(READING_PAUSE_S)
        else:
            events = dict(poller.poll(WAITING_POLL_MS if self._tasks else IDLE_POLL_MS))
        if self._wake_r.fileno() in events:
            with contextlib.suppress(BlockingIOError):
                while self._wake_r.recv(4096):
                    pass
        while True:
            try:
                task = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._begin(task)
        for link in list(self._links.values()):
            if link.socket in events:
                self._receive(link)
        now = self._clock()
        for task in list(self._tasks):
            self._progress(task, now)
        self._drain_quarantine()

    # ----------------------------------------------------------- lookups

    def _link(self, peer: PeerAddress) -> _Link:
        link = self._links.get(peer)
        if link is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a peer not connected
            sock.connect(f"tcp://{peer.host}:{peer.port}")
            link = _Link(sock)
            self._links[peer] = link
        return link

    def _begin(self, task: FetchTask) -> None:
        self._tasks.append(task)
        self.counters.remote_lookups += len(task.items)
        for peer in task.candidates:
            self._ask(task, peer, list(task.items.values()))
        self._progress(task, self._clock())

    def _ask(self, task: FetchTask, peer: PeerAddress, items: list[ItemFetch]) -> None:
        link = self._link(peer)
        now = self._clock()
        if link.incompatible:
            for item in items:
                item.answers[peer] = "incompatible"
            return
        if link.down_until > now:
            for item in items:
                item.answers[peer] = "unreachable"
            return
        nonce = next(self._nonces)
        lookup = Lookup(
            nonce=nonce,
            sent_at=time.time(),
            fingerprint=self._fingerprint,
            items=[(i.wanted.key, i.wanted.rows, i.wanted.cols) for i in items],
        )
        try:
            link.socket.send_multipart(seal(lookup, self._secret), zmq.NOBLOCK)
        except zmq.Again:
            # Not connected (yet): IMMEDIATE queues nothing for it. Try again soon;
            # at the lookup deadline it counts as unreachable.
            for item in items:
                item.retry_at[peer] = now + CONNECT_RETRY_S
            return
        self._pending[nonce] = (peer, task)
        for item in items:
            item.asked.add(peer)
            item.retry_at.pop(peer, None)
            item.answers.pop(peer, None)  # asked (again): its answer is awaited

    def _peer_down(self, peer: PeerAddress, why: str) -> None:
        link = self._links[peer]
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
        while True:
            try:
                frames = link.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = open_frames(frames, self._secret)
            except WireError as exc:
                self._warnings.warn("bad-reply", "EC CPU tier: dropped a peer reply: %s", exc)
                continue
            if isinstance(reply, Reply):
                self._apply(link, reply)

    def _apply(self, link: _Link, reply: Reply) -> None:
        waiting = self._pending.pop(reply.nonce, None)
        if waiting is None:  # an answer that came too late: give its leases back
            self._release(link, reply.lease, [k for k, s, _ in reply.results if s == OK])
            return
        peer, task = waiting
        if reply.status == INCOMPATIBLE:
            if not link.incompatible:
                logger.warning(
                    "EC CPU tier: peer %s runs an incompatible engine (model, dtype, "
                    "embedding width, block size or wire version differ); it is not asked "
                    "again and its items are encoded here",
                    peer,
                )
            link.incompatible = True
            for item in task.items.values():
                item.answers[peer] = "incompatible"
            return
        not_needed: list[str] = []
        for key, status, spans in reply.results:
            found = task.items.get(key)
            if found is None or found.outcome is not None or found.reading is not None:
                if status == OK:
                    not_needed.append(key)
                continue
            item = found
            item.heard.add(peer)
            if status == OK:
                if task.done or not self._start_read(task, item, peer, reply, spans):
                    not_needed.append(key)
                else:
                    self._poll_read(item)  # a small READ may be done already
            elif status == SAVING:
                item.answers[peer] = "not_ready"
                item.retry_at[peer] = self._clock() + SAVING_RETRY_S
            else:
                item.answers[peer] = {MISSING: "missing", SHAPE: "shape"}.get(status, "missing")
        self._release(link, reply.lease, not_needed)

    def _release(self, link: _Link, lease: int, keys: list[str], *, read: bool = False) -> None:
        if not lease or not keys:
            return
        release = Release(
            nonce=next(self._nonces), sent_at=time.time(), lease=lease, keys=keys, read=read
        )
        with contextlib.suppress(zmq.Again):  # else the producer's lease expires by itself
            link.socket.send_multipart(seal(release, self._secret), zmq.NOBLOCK)

    # -------------------------------------------------------------- reads

    def _start_read(
        self,
        task: FetchTask,
        item: ItemFetch,
        peer: PeerAddress,
        reply: Reply,
        remote: list[tuple[int, int]],
    ) -> bool:
        """Reserve blocks and start the READ; False (nothing held) if it cannot start."""
        wanted = item.wanted
        nbytes = wanted.rows * wanted.cols * self._itemsize
        if sum(n for _, n in remote) != nbytes:
            item.answers[peer] = "shape"
            return False
        runs = self._local.reserve(wanted.key, wanted.rows, wanted.cols)
        if runs is None:
            self._finish(item, "no_space")
            return False
        try:
            pieces = list(paired_spans(self._spans(runs, nbytes), remote))
            agent = self.agent.know(reply.agent, reply.agent_metadata)
            # No NIXL notification: the READ then completes here without waiting for
            # the producer to poll; the Release sent when it is over unpins the entry.
            item.reading = self.agent.read(agent, pieces)
        except Exception as exc:
            # Nothing was enqueued (or NIXL refused it at once): the blocks are free.
            self._local.abandon(wanted.key)
            self._warnings.warn("read", "EC CPU tier: a READ from %s failed: %s", peer, exc)
            item.answers[peer] = "read_error"
            return False
        item.peer = peer
        item.lease = reply.lease
        now = self._clock()
        item.read_started = now
        item.lease_until = now + reply.lease_s - LEASE_MARGIN_S
        return True

    def _poll_read(self, item: ItemFetch) -> None:
        state = self.agent.state(item.reading)
        if state == "PROC":
            return
        handle, item.reading = item.reading, None
        self.agent.release(handle)
        self._read_over(item.peer, item.lease, item.wanted.key, read=state == "DONE")
        now = self._clock()
        if state == "DONE" and now <= item.lease_until and self._local.landed(item.wanted.key):
            self.counters.remote_hits += 1
            self.counters.bytes_fetched += item.wanted.rows * item.wanted.cols * self._itemsize
            self.counters.fetch_seconds += now - item.read_started
            self._finish(item, "landed")
            return
        self._local.abandon(item.wanted.key)
        self._finish(item, "read_error")

    # --------------------------------------------------------- deadlines

    def _progress(self, task: FetchTask, now: float) -> None:
        for item in task.items.values():
            if item.outcome is not None:
                continue
            if item.reading is not None:
                if now > task.deadline:
                    self._give_up_read(item)
                else:
                    self._poll_read(item)
                continue
            for peer, when in list(item.retry_at.items()):
                if when <= now < task.lookup_deadline:
                    self._ask(task, peer, [item])
            if item.reading is None and item.outcome is None:
                self._decide(task, item, now)
        if all(item.outcome is not None for item in task.items.values()):
            task.done = True
            self._tasks.remove(task)
            for nonce in [n for n, (_, t) in self._pending.items() if t is task]:
                del self._pending[nonce]  # late answers release their leases

    def _decide(self, task: FetchTask, item: ItemFetch, now: float) -> None:
        """Fail an item no peer can still provide; after the lookup deadline, mark the
        peers that never answered down."""
        waiting = [p for p in task.candidates if p not in item.answers or p in item.retry_at]
        if waiting and now < task.lookup_deadline:
            return
        for peer in waiting:
            if peer in item.heard and item.answers.get(peer) is None:
                item.answers[peer] = "not_ready"  # it answered "saving" until the deadline
            elif peer not in item.answers:
                item.answers[peer] = "unreachable"
                self._peer_down(
                    peer, "no answer in time (wrong ec_peer_secret, stopped, or overloaded)"
                )
        causes = set(item.answers.values())
        cause = next((c for c in CAUSE_ORDER if c in causes), None)
        self._finish(item, cause or "unreachable")

    def _give_up_read(self, item: ItemFetch) -> None:
        handle, item.reading = item.reading, None
        if self.agent.release(handle):
            self._local.abandon(item.wanted.key)
            self._read_over(item.peer, item.lease, item.wanted.key, read=False)
        else:
            self._quarantine.append((handle, item.wanted.key, item.peer, item.lease))
        self._finish(item, "timeout")

    def _drain_quarantine(self) -> None:
        still = []
        for handle, key, peer, lease in self._quarantine:
            if self.agent.state(handle) == "PROC" or not self.agent.release(handle):
                still.append((handle, key, peer, lease))
            else:
                self._local.abandon(key)
                self._read_over(peer, lease, key, read=False)
        self._quarantine = still

    def _read_over(self, peer: PeerAddress | None, lease: int, key: str, *, read: bool) -> None:
        """A READ from `peer` will touch its memory no more: give the pin back."""
        link = self._links.get(peer) if peer is not None else None
        if link is not None:
            self._release(link, lease, [key], read=read)

    def _finish(self, item: ItemFetch, outcome: str) -> None:
        item.outcome = outcome
        if outcome != "landed":
            self.counters.fell_back(outcome)
            self._on_failed(item.wanted.key, outcome)

    def _shutdown(self) -> None:
        for task in self._tasks:
            for item in task.items.values():
                if item.reading is not None:
                    self._give_up_read(item)
                elif item.outcome is None:
                    self._finish(item, "timeout")
            task.done = True
        self._tasks.clear()
        for link in self._links.values():
            link.socket.close(0)
        self.agent.close()
