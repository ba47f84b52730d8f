"""Fetcher: a consumer fetches the items a request lacks from its peers, in a thread of its own.

Runs in the scheduler process. The scheduler thread stages one FetchTask per
request (`submit`), hands a step's tasks over together at its end (`kick`),
and reads only `task.done`; everything else happens on the fetcher thread.
Each pass of the thread asks every peer, in one Lookup, for all the items the
tasks handed over since the last pass want from it (the requests of one
engine step therefore cost one round trip per peer), and reads all the items
one Reply leased with one NIXL READ, into local blocks reserved as not-ready
entries. A task may carry a request-level handle's pre-granted lease: its
items are claimed and read at once (`claims`).

The thread's work is split by job, each container with one owner:

    intake      Intake      tasks handed over by the scheduler thread
    links       Links       a socket per peer; which peers may be asked
    asks        Asks        items to ask each peer for at the end of the pass
    lookups     Lookups     Lookups and claims out, and what their Replies decide
    claims      Claims      handle leases to claim at the start of the next pass
    reads       Reads       READs running, and handle READs awaiting confirmation
    quarantine  Quarantine  READs given up that NIXL still holds
    releases    Releases    pins to give back to producers
    deadlines   Deadlines   open tasks; when an item fails, and why

and each item's progress through them is one state machine (`stages`).

Every path ends in one of two outcomes per item: *landed* (the entry is ready
in this engine's region and the workers load it like any other) or *failed*
with a cause (the request then encodes it).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from ec_core._vllm import get_logger
from ec_core.ratelimit import RateLimitedWarnings
from ec_transfer_nixl.agent import RegionAgent, Span
from ec_transfer_nixl.asks import Asks
from ec_transfer_nixl.claims import Claims
from ec_transfer_nixl.counters import PeerCounters
from ec_transfer_nixl.deadlines import Deadlines
from ec_transfer_nixl.intake import IDLE_POLL_MS, Intake
from ec_transfer_nixl.links import Links
from ec_transfer_nixl.lookups import Lookups
from ec_transfer_nixl.quarantine import Quarantine
from ec_transfer_nixl.reads import Reads
from ec_transfer_nixl.releases import Releases
from ec_transfer_nixl.shapes import Shapes
from ec_transfer_nixl.stages import Stage

if TYPE_CHECKING:
    from ec_core.peer_secrets import PeerSecrets
    from ec_core.peer_settings import PeerAddress
    from ec_scheduler.remote import LocalEntries
    from ec_transfer_nixl.tasks import FetchTask

logger = get_logger(__name__)

WAITING_POLL_MS = 1
"""While lookups are out: a reply wakes the poll at once anyway."""
READING_PAUSE_S = 0.00005
"""While READs run: NIXL progresses them when their state is checked, so check often."""


class Fetcher:
    """The consumer side of cross-engine fetching: a thread that fetches the items
    the scheduler thread's tasks want from peers.

    Guarantees: `submit` and `kick` never block; every task handed over is done
    (`task.done`) by its deadline, each item landed or failed with a cause (once
    the thread stops, every open item fails); a reservation whose READ may still
    write is never freed (`Quarantine`); every lease a peer grants this engine is
    given back, or expires at the peer.
    """

    def __init__(
        self,
        *,
        context: zmq.Context[Any],
        keys: PeerSecrets,
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
        self._make_agent = make_agent
        self.counters = counters
        self._clock = clock
        self.agent: RegionAgent
        """This engine's NIXL agent (made on the thread, when it starts)."""
        warnings = RateLimitedWarnings(logger)
        nonces = itertools.count(1)
        agent = self._the_agent
        self._intake = Intake(clock)
        self._links = Links(
            context=context,
            keys=keys,
            agent=agent,
            warnings=warnings,
            clock=clock,
            busy=self._busy_peers,
        )
        self._asks = Asks()
        self._releases = Releases(links=self._links, keys=keys, nonces=nonces)
        self._quarantine = Quarantine(local=local, agent=agent, releases=self._releases)
        self._deadlines = Deadlines(
            counters=counters, on_failed=on_failed, links=self._links, asks=self._asks
        )
        shapes = Shapes(embed_width=embed_width, itemsize=itemsize, warnings=warnings)
        self._reads = Reads(
            local=local,
            spans=spans,
            shapes=shapes,
            agent=agent,
            counters=counters,
            links=self._links,
            releases=self._releases,
            deadlines=self._deadlines,
            asks=self._asks,
            quarantine=self._quarantine,
            forget_claim=self._forget_claim,
            warnings=warnings,
            clock=clock,
        )
        self._lookups = Lookups(
            links=self._links,
            asks=self._asks,
            reads=self._reads,
            releases=self._releases,
            shapes=shapes,
            keys=keys,
            fingerprint=fingerprint,
            nonces=nonces,
            clock=clock,
        )
        self._claims = Claims(
            links=self._links,
            asks=self._asks,
            lookups=self._lookups,
            reads=self._reads,
            shapes=shapes,
        )
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ec-cpu-peer-fetcher", daemon=True)

    def _the_agent(self) -> RegionAgent:
        return self.agent

    def _forget_claim(self, nonce: int) -> None:
        self._lookups.forget(nonce)

    # ------------------------------------------------ the scheduler thread

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    @property
    def clock(self) -> Callable[[], float]:
        """The clock this fetcher reads (`time.monotonic` unless a test gave another):
        a task's deadlines are times on it."""
        return self._clock

    @property
    def running(self) -> bool:
        """Whether the thread still takes tasks on (False once it stopped, asked to or not)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, task: FetchTask) -> None:
        """Stage a task for the fetcher thread (never blocks); see `Intake` for when it
        is taken on."""
        self._intake.submit(task)

    def kick(self) -> None:
        """Hand the staged tasks over as one batch and wake the thread (never blocks)."""
        if self._stop.is_set():
            return  # what is staged fails at the thread's end
        self._intake.kick()

    def stop(self) -> bool:
        """Stop the thread (open fetches fail, reads are released or quarantined);
        False if it did not end in time."""
        self._stop.set()
        self._intake.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        stopped = not self._thread.is_alive()
        if stopped:
            self._intake.close()
        return stopped

    @property
    def quarantined(self) -> int:
        """READs past their deadline that NIXL has not finished yet (blocks held)."""
        return len(self._quarantine)

    @property
    def handle_reads(self) -> int:
        """Items READ on a handle's lease before any answer (for tests and benchmarks)."""
        return self._reads.handle_reads

    @property
    def handle_batches(self) -> int:
        """NIXL READs those were read with (one per producer and pass)."""
        return self._reads.handle_batches

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
        wakes = self._intake.wakes
        poller = self._links.poller(wakes)
        if self._reads.running or self._quarantine.groups:
            events = dict(poller.poll(0))
            if not events:
                time.sleep(READING_PAUSE_S)
        else:
            busy = self._deadlines.tasks or self._reads.awaiting
            events = dict(poller.poll(WAITING_POLL_MS if busy else IDLE_POLL_MS))
        if wakes.fileno() in events:
            self._intake.drain_wakes()
        for task in self._intake.take():
            self._begin(task)
        self._claims.flush()  # before the replies are read: their READs start first
        for link, reply in self._links.replies(events):
            self._lookups.apply(link, reply)
        self._tick(self._clock())

    def _begin(self, task: FetchTask) -> None:
        """Take a task on; its lookups go out at the end of this pass, the claim of its
        handle's lease (with those of the pass's other handles) at its start."""
        self._deadlines.take_on(task)
        claimed = self._claims.take_on(task) if task.handle is not None else []
        taken = {item.wanted.key for item in claimed}
        queue = self._asks.queue
        for key, item in task.items.items():
            if key not in taken:
                item.move(Stage.LOOKING_UP)
                for peer in task.candidates:
                    queue(peer, task, item)

    def _tick(self, now: float) -> None:
        """One pass over everything open: claims and READs, lookups to send, deadlines,
        quarantine."""
        self._claims.flush()
        self._reads.check(now)
        self._lookups.flush()
        for task in list(self._deadlines.tasks):
            if self._deadlines.progress(task, now):
                self._lookups.forget_task(task)
        self._lookups.flush()
        self._quarantine.drain()
        self._releases.flush()

    def _busy_peers(self) -> set[PeerAddress]:
        """The peers open work uses: their links are kept however many there are."""
        busy = self._deadlines.peers | self._lookups.peers | self._reads.peers
        busy.update(group.peer for group in self._quarantine.groups)
        busy.update(self._asks.peers)
        busy.update(self._claims.peers)
        busy.update(self._releases.peers)
        return busy

    def _drop_idle_links(self) -> None:
        """Close the links no open work uses and that were not asked lately."""
        self._links.drop_idle(self._busy_peers())

    def _shutdown(self) -> None:
        try:
            # Tasks handed over or staged but never taken on fail with the open ones.
            untaken = self._intake.take(all_staged=True)
            self._reads.end_all()
            self._deadlines.fail_all("timeout", untaken)
            self._releases.flush()
        finally:
            # Whatever failed above: a socket left open would hang the context's
            # term(), and with it the engine's shutdown.
            self._links.close()
            self.agent.close()
