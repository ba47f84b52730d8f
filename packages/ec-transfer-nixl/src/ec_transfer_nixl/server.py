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
from ec_transfer_nixl.leases import Leases, keys_by_lease
from ec_transfer_nixl.sockets import peer_socket
from ec_transfer_nixl.wire import (
    INCOMPATIBLE,
    LAPSED,
    MISSING,
    OK,
    SAVING,
    SHAPE,
    Lookup,
    Release,
    Replays,
    Reply,
    WireError,
    open_frame,
    seal,
)

if TYPE_CHECKING:
    from ec_core.peer_secrets import PeerSecrets
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
BATCH_MAX = 4096
"""Messages one pass takes at most; the rest wait for the next pass. Anyone reaching
the port can send faster than signatures are checked: without a bound, such a flood
would keep the thread reading, answering nobody and letting no lease expire."""


class PeerServer:
    """The producer side: a ROUTER socket, a NIXL agent over the region, the leases."""

    def __init__(
        self,
        *,
        context: zmq.Context[Any],
        listen: PeerAddress,
        keys: PeerSecrets,
        fingerprint: str,
        local: LocalEntries,
        make_agent: Callable[[], RegionAgent],
        spans: Callable[[tuple[tuple[int, int], ...], int], list[Span]],
        itemsize: int,
        lease_s: float,
        handle_lease_s: float = 0.0,
        counters: PeerCounters,
    ) -> None:
        self._context = context
        self._listen = listen
        self._keys = keys
        self._fingerprint = fingerprint
        self._local = local
        self._make_agent = make_agent
        self._spans = spans
        self._itemsize = itemsize
        self._lease_s = lease_s
        self.counters = counters
        self.leases = Leases(local.release)
        self.handle_lease_s = min(handle_lease_s, lease_s)
        """How long a request-level handle's lease pins its entries unclaimed
        (`ec_peer_handle_lease_s`; 0: handles carry no lease)."""
        self.answer_seconds: collections.deque[float] = collections.deque(maxlen=ANSWER_TIMES_KEPT)
        """How long the latest batches of lookups took in this thread, from the first
        message taken off the socket to the last reply sent (for benchmarks and
        debugging; bounded), and how many lookups each batch held."""
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=ANSWER_TIMES_KEPT)
        self.busy_seconds = 0.0
        """CPU time this thread spent taking messages and answering lookups, in all
        (`time.thread_time`: not the waits for the GIL or for messages)."""
        self.lookups_answered = 0
        self._warnings = RateLimitedWarnings(logger)
        self._replays = Replays()
        self._stop = threading.Event()
        self._stopped = False
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
        self._stopped = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        return not self._thread.is_alive()

    # ------------------------------------------------------------- thread

    def grant_handle(self, keys: dict[str, tuple[int, int]]) -> tuple[int, dict[str, list[Span]]]:
        """Scheduler thread (`request_finished`, under the scheduler's lock): pin the
        ready ones of `keys` (key -> shape) for a request-level handle, for
        HANDLE_LEASE_S; the lease id and the spans of the pinned keys (0, {} if none)."""
        if self._stopped:
            return 0, {}
        items = [(key, rows, cols) for key, (rows, cols) in keys.items()]
        leased: dict[str, int] = {}
        spans: dict[str, list[Span]] = {}
        for (key, rows, cols), (state, runs, _) in zip(
            items, self._local.lease_many(items, reads=False), strict=True
        ):
            if state == "ready":
                nbytes = rows * cols * self._itemsize
                leased[key] = nbytes
                spans[key] = self._spans(runs, nbytes)
        lease = self.leases.grant(leased, self.handle_lease_s, claimable=spans)
        return lease, spans if lease else {}

    def _run(self) -> None:
        socket = None
        try:
            socket = peer_socket(self._context, zmq.ROUTER, self._listen)
            socket.bind(self._listen.endpoint)
            agent = self._make_agent()
        except BaseException as exc:
            # Closed here, or the context's term() at shutdown waits for it forever.
            if socket is not None:
                socket.close(0)
            self._error = RuntimeError(f"EC CPU tier: cannot serve peers on {self._listen}: {exc}")
            self._ready.set()
            return
        self.agent = agent
        self._ready.set()
        logger.info("EC CPU tier: serving entries to peers on %s", self._listen)
        leases = self.leases
        failed = False
        try:
            while not self._stop.is_set():
                # An unclaimed handle lease has no READ running: no need to poll fast.
                timeout = LEASED_POLL_MS if leases.active else IDLE_POLL_MS
                if socket.poll(timeout):
                    self._serve(socket)
                agent.notifications()  # drives NIXL's progress; none are sent
                leases.expire()
        except Exception:
            # A bug, not a peer's doing (a bad message is dropped where it is read).
            # Consumers then get no answer and encode locally.
            failed = True
            logger.exception("EC CPU tier: the peer server stopped on an unexpected error")
        finally:
            self._stopped = True
            socket.close(0)
            agent.close()
            if failed:
                # A consumer answered before the error may still READ under its lease,
                # and trusts the bytes until the lease ends: its pins stay until then
                # (or until the engine stops), else the entry could be overwritten mid-READ.
                while len(leases) and not self._stop.wait(IDLE_POLL_MS / 1000):
                    leases.expire()
            leases.release_all()

    def _serve(self, socket: zmq.Socket[Any]) -> None:
        """Take the messages queued (BATCH_MAX at most), and answer all their lookups
        together: one acquisition of the scheduler's lock for the batch, the replies
        sent after."""
        began, began_cpu = time.perf_counter(), time.thread_time()
        recv = socket.recv
        received: list[tuple[bytes, bytes]] = []
        # EVENTS is read without letting go of the GIL; a recv that finds nothing would
        # let go of it (and wait to take it back) only to raise.
        for _ in range(BATCH_MAX):
            if not int(socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                break
            routing = recv(zmq.NOBLOCK)
            if not socket.getsockopt(zmq.RCVMORE):
                continue  # a frame without a routing id: not a peer's message
            body = recv(zmq.NOBLOCK)
            while socket.getsockopt(zmq.RCVMORE):  # more frames: not this wire's message
                recv(zmq.NOBLOCK)  # (its first frame is refused)
            received.append((routing, body))
        lookups: list[tuple[bytes, Lookup]] = []
        releases: list[Release] = []
        now = time.time()
        accepted = self._keys.accepted
        for routing, body in received:
            try:
                message = open_frame(body, accepted, now)
            except WireError as exc:
                self.counters.requests_denied += 1
                self._warnings.warn("denied", "EC CPU tier: dropped a peer message: %s", exc)
                continue
            if not self._replays.first(body, message, now):
                self.counters.requests_denied += 1
                self._warnings.warn("replay", "EC CPU tier: dropped a replayed peer message")
                continue
            if isinstance(message, Lookup):
                lookups.append((routing, message))
            elif isinstance(message, Release):
                releases.append(message)
        if releases:
            self._give_back(releases)
        if not lookups:
            return
        replies = self._answer_all([lookup for _, lookup in lookups])
        send = socket.send
        signing = self._keys.signing
        for (routing, _), reply in zip(lookups, replies, strict=True):
            send(routing, zmq.SNDMORE)
            send(seal(reply, signing))
        self.answer_seconds.append(time.perf_counter() - began)
        self.batch_sizes.append(len(lookups))
        self.busy_seconds += time.thread_time() - began_cpu
        self.lookups_answered += len(lookups)

    def _give_back(self, releases: list[Release]) -> None:
        """Every lease the messages of one batch release, with one release of their pins."""
        returned = [pair for release in releases for pair in release.leases]
        released = self.leases.give_back_many(returned)
        at = 0
        for release in releases:
            count = len(release.leases)
            if release.read:  # the READ is over: those bytes were served
                self.counters.bytes_served += sum(
                    nbytes for pairs in released[at : at + count] for _, nbytes in pairs
                )
            at += count

    def _answer_all(self, lookups: list[Lookup]) -> list[Reply]:
        """The replies to `lookups`, in order: the claims first, then every ordinary
        lookup's items leased under one acquisition of the scheduler's lock."""
        now = time.time()
        name, metadata = self.agent.name, self.agent.metadata
        replies: list[Reply] = []
        asked: list[tuple[str, int, int]] = []
        answering: list[tuple[Reply, list[tuple[str, int, int]]]] = []
        for lookup in lookups:
            reply = Reply(
                nonce=lookup.nonce,
                sent_at=now,
                status=OK,
                agent=name,
                agent_metadata=b"" if lookup.known_agent == name else metadata,
                lease_s=self._lease_s,
                results=[],
                leases=[],
                shapes=[],
            )
            replies.append(reply)
            if lookup.fingerprint != self._fingerprint:
                reply.status = INCOMPATIBLE
            elif lookup.claims:
                self._claim(lookup, reply)
            else:
                items = list({key: (key, r, c) for key, r, c in lookup.items}.values())
                asked.extend(items)  # a key asked twice in one lookup: answered once
                answering.append((reply, items))
        if not asked:
            return replies
        states = self._local.lease_many(asked)
        at = 0
        itemsize, spans, counters = self._itemsize, self._spans, self.counters
        for reply, items in answering:
            leased: dict[str, int] = {}
            results, shapes = reply.results, reply.shapes
            answered, at = states[at : at + len(items)], at + len(items)
            for (key, _, _), (state, runs, held) in zip(items, answered, strict=True):
                # The shape the entry is held in, whatever was asked: a consumer that
                # asked for any width (ANY_WIDTH) learns it here, one that asked for
                # another shape can say which it was offered.
                shapes.append(held or (0, 0))
                if state == "ready" and held is not None:
                    nbytes = held[0] * held[1] * itemsize
                    results.append((key, OK, spans(runs, nbytes)))
                    leased[key] = nbytes
                elif state == "saving":
                    counters.lookups_not_ready += 1
                    results.append((key, SAVING, []))
                else:
                    results.append((key, SHAPE if state == "shape" else MISSING, []))
            lease = self.leases.grant(leased, self._lease_s)
            reply.leases = [lease if status == OK else 0 for _, status, _ in results]
            counters.lookups_served += len(leased)
        return replies

    def _claim(self, lookup: Lookup, reply: Reply) -> None:
        """A consumer that READs with handles claims their leases (each item under its
        own, `claims`): per item, the same spans if its lease still pins it, else
        LAPSED; `reply.leases` says which lease holds each."""
        keys = [key for key, _, _ in lookup.items]
        if len(lookup.claims) == len(keys):
            under = lookup.claims
        else:  # malformed: nothing is claimed
            under = [0] * len(keys)
        asked: dict[str, int] = {}
        for key, lease in zip(keys, under, strict=True):
            asked.setdefault(key, lease)  # a key named twice: answered once, under its first
        # An entry invalidated since its handle was issued (vLLM reset its encoder
        # cache: new weights) is not claimed: LAPSED, and its lease lets go of it
        # (a lease is claimed even when none of its keys is, which releases them).
        states = self._local.state_many(asked)
        current = [key for key, state in zip(asked, states, strict=True) if state == "ready"]
        by_lease: dict[int, list[str]] = {lease: [] for lease in asked.values() if lease}
        by_lease.update(keys_by_lease(asked, current))
        found = self.leases.claim_many(by_lease, self._lease_s) if by_lease else {}
        results, leases = reply.results, reply.leases
        served: list[str] = []
        for key, lease in asked.items():
            spans = found[lease].get(key) if lease in found else None
            if spans is None:
                results.append((key, LAPSED, []))
                leases.append(0)
            else:
                results.append((key, OK, spans))
                leases.append(lease)
                served.append(key)
        self.counters.lookups_served += len(served)
        if served:
            self._local.note_reads(served)
