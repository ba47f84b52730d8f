"""PeerServer: a producer answers lookups from other engines in a thread of its own.

Runs in the scheduler process, off vLLM's engine loop, so an answer takes a
lock acquisition and a few dictionary lookups, never an engine step. Per
lookup it pins the ready entries asked for (a lease), returns the addresses
of their bytes in this engine's region, and keeps them pinned until the
consumer releases them (after its READ, or instead of it) or the lease expires.
It never announces an entry that is not ready.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from ec_core._vllm import get_logger
from ec_core.ratelimit import RateLimitedWarnings
from ec_transfer_nixl.agent import RegionAgent, Span
from ec_transfer_nixl.counters import PeerCounters
from ec_transfer_nixl.leases import Leases
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
    from ec_scheduler.remote import LocalEntries

logger = get_logger(__name__)

LEASED_POLL_MS = 1
"""Poll interval while leases are out. Over a transport where this side must take
part in a READ (UCX over TCP), NIXL progresses it only as this thread polls; on
the same host the consumer copies by itself. A sleep in epoll, not a spin: a
spinning thread would take a core from the engine's OpenMP threads."""
IDLE_POLL_MS = 50
ANSWER_TIMES_KEPT = 4096


class PeerServer:
    """The producer side: a ROUTER socket, a NIXL agent over the region, the leases."""

    def __init__(
        self,
        *,
        context: zmq.Context[Any],
        listen: PeerAddress,
        secret: bytes,
        fingerprint: str,
        local: LocalEntries,
        make_agent: Callable[[], RegionAgent],
        spans: Callable[[tuple[tuple[int, int], ...], int], list[Span]],
        itemsize: int,
        lease_s: float,
        counters: PeerCounters,
    ) -> None:
        self._context = context
        self._listen = listen
        self._secret = secret
        self._fingerprint = fingerprint
        self._local = local
        self._make_agent = make_agent
        self._spans = spans
        self._itemsize = itemsize
        self._lease_s = lease_s
        self.counters = counters
        self.leases = Leases(local.release)
        self.answer_seconds: collections.deque[float] = collections.deque(maxlen=ANSWER_TIMES_KEPT)
        """How long the latest lookups took in this thread, from the received message
        to the sent reply (for benchmarks and debugging; bounded)."""
        self._warnings = RateLimitedWarnings(logger)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ec-cpu-peer-server", daemon=True)

    def start(self) -> None:
        """Bind and start answering; raise (before returning) if the address cannot be bound."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def stop(self) -> bool:
        """Stop the thread (its leases are released); False if it did not end in time."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        return not self._thread.is_alive()

    # ------------------------------------------------------------- thread

    def _run(self) -> None:
        try:
            socket = self._context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(f"tcp://{self._listen.host}:{self._listen.port}")
            agent = self._make_agent()
        except BaseException as exc:
            self._error = RuntimeError(f"EC CPU tier: cannot serve peers on {self._listen}: {exc}")
            self._ready.set()
            return
        self.agent = agent
        self._ready.set()
        logger.info("EC CPU tier: serving entries to peers on %s", self._listen)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                timeout = LEASED_POLL_MS if len(self.leases) else IDLE_POLL_MS
                if poller.poll(timeout):
                    while True:
                        try:
                            frames = socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(socket, frames)
                self.agent.notifications()  # drives NIXL's progress; none are sent
                self.leases.expire()
        finally:
            self.leases.release_all()
            socket.close(0)
            agent.close()

    def _handle(self, socket: zmq.Socket[Any], frames: list[bytes]) -> None:
        began = time.perf_counter()
        routing, *body = frames
        try:
            message = open_frames(body, self._secret)
        except WireError as exc:
            self.counters.requests_denied += 1
            self._warnings.warn("denied", "EC CPU tier: dropped a peer message: %s", exc)
            return
        if isinstance(message, Lookup):
            reply = self._answer(message)
            socket.send_multipart([routing, *seal(reply, self._secret)])
            self.answer_seconds.append(time.perf_counter() - began)
        elif isinstance(message, Release):
            released = self.leases.give_back(message.lease, message.keys)
            if message.read:  # the READ is over: those bytes were served
                self.counters.bytes_served += sum(nbytes for _, nbytes in released)

    def _answer(self, lookup: Lookup) -> Reply:
        """Lease every ready item of the lookup's shape; the statuses and addresses."""
        reply = Reply(
            nonce=lookup.nonce,
            sent_at=time.time(),
            status=OK,
            agent=self.agent.name,
            agent_metadata=self.agent.metadata,
            lease=0,
            lease_s=self._lease_s,
            results=[],
        )
        if lookup.fingerprint != self._fingerprint:
            reply.status = INCOMPATIBLE
            return reply
        leased: dict[str, int] = {}
        for key, rows, cols in lookup.items:
            if key in leased or any(key == done for done, _, _ in reply.results):
                continue  # asked twice in one lookup: answered (and pinned) once
            state, runs = self._local.lease(key, rows, cols)
            if state != "ready":
                status = {"saving": SAVING, "shape": SHAPE}.get(state, MISSING)
                self.counters.lookups_not_ready += status == SAVING
                reply.results.append((key, status, []))
                continue
            nbytes = rows * cols * self._itemsize
            reply.results.append((key, OK, list(self._spans(runs, nbytes))))
            leased[key] = nbytes
        reply.lease = self.leases.grant(leased, self._lease_s)
        self.counters.lookups_served += len(leased)
        return reply
