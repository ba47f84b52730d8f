"""NixlRemoteSource: the scheduler's remote source over NIXL and ZMQ.

Runs in the scheduler process. It maps this engine's region (the workers
created it), and starts a PeerServer when `ec_peer_listen` is set and a
Fetcher on a consumer role; `wants` and `request_finished` are called by the
scheduler thread under the scheduler's lock and never block.

Request-level handles: `request_finished` returns, for the items of a
request this engine holds (ready, or being saved),

    {"ec_cpu_tier": {"version": 2, "peer": "HOST:PORT", "fingerprint": "...",
                     "items": {key: [rows, cols], ...},
                     "lease": {"id": 17, "agent": "...", "spans": {key: [[addr, n], ...]},
                               "issued": 1764000000.5, "ttl": 10.0, "sig": "hex"}}}

which vLLM puts on the output's `ec_transfer_params` (none for a request vLLM
aborted or failed: it drops what `request_finished` returns for those). A
consumer request that carries it (`SamplingParams.extra_args["ec_transfer_params"]`,
or the HTTP request's top-level field) asks that producer too, with or without
`ec_peers`.

`lease` (only when some items are ready) is a pre-granted lease: those items
are pinned from now for `ttl` seconds (`ec_peer_handle_lease_s`; off, and no
`lease`, by default) or until a consumer
claims and releases them, and `sig` (HMAC-SHA256 with the shared secret, over
every other field) makes it unforgeable. A consumer that knows the
producer's NIXL agent already READs them at once and confirms the lease while
the READ runs (see `ec_transfer_nixl.claims`). The handle carries no NIXL
metadata: without the secret, nobody can read the producer's region with it.
"""

from __future__ import annotations

import collections
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import zmq

from ec_core._vllm import get_logger
from ec_core.peer_settings import PeerAddress
from ec_core.ratelimit import RateLimitedWarnings
from ec_core.region.opening import open_region
from ec_transfer_nixl.agent import RegionAgent, Span
from ec_transfer_nixl.counters import PeerCounters
from ec_transfer_nixl.fetcher import Fetcher
from ec_transfer_nixl.server import PeerServer
from ec_transfer_nixl.tasks import FetchTask, HandleLease, ItemFetch
from ec_transfer_nixl.wire import (
    WIRE_VERSION,
    fingerprint,
    handle_signature,
    handle_signed,
    overrides_text,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from ec_core.layout import RegionLayout
    from ec_scheduler.remote import LocalEntries, Wanted

logger = get_logger(__name__)

HANDLE_KEY = "ec_cpu_tier"
HANDLE_TTL_MARGIN_S = 0.5
"""A handle lease this close to its end (by this host's clock) is not READ at once."""
NEGATIVE_TTL_S = 5.0
"""How long an item no peer could provide is not asked for again."""
NEGATIVE_MAX = 10_000
NEGATIVE_CAUSES = frozenset({"missing", "shape", "incompatible"})
DROPPED_STATUSES = frozenset({"FINISHED_ABORTED", "FINISHED_ERROR"})
"""How vLLM ends the requests whose `request_finished` result it throws away (aborted:
a client gone, a proxy's timeout; failed): no handle is made for them."""


class NixlRemoteSource:
    """A `RemoteSource` (ec_scheduler.remote) over NIXL READs and a ZMQ control plane."""

    def __init__(self, vllm_config: VllmConfig, layout: RegionLayout, local: LocalEntries) -> None:
        peers = layout.settings.peers
        ec_config = vllm_config.ec_transfer_config
        if peers is None or ec_config is None:
            raise ValueError("NixlRemoteSource needs peer settings")
        self._settings = peers
        self._local = local
        self._itemsize = layout.dtype.itemsize
        self._block = layout.block_size_bytes
        self.counters = PeerCounters()
        self._warnings = RateLimitedWarnings(logger)
        model = vllm_config.model_config
        self.fingerprint = fingerprint(
            model=str(model.model),
            revision=model.revision,
            dtype=str(layout.dtype),
            embed_width=layout.embed_width,
            block_bytes=layout.block_size_bytes,
            overrides=overrides_text(getattr(model, "hf_overrides", None)),
        )
        self._region = open_region(layout)  # joins the file the workers created
        self._base = self._region.base_address
        self._nbytes = self._region.nbytes
        self._context: zmq.Context[Any] = zmq.Context()
        self._tasks: dict[str, FetchTask] = {}
        self._fetching: dict[str, FetchTask] = {}
        """Items being fetched, and the task fetching each (one task per item at a time).
        Invariant: every task in it belongs to a live request (`_tasks`) or waits in
        `_finished`, so it holds only what is in flight or just done."""
        self._finished: list[FetchTask] = []
        """Tasks of finished requests whose items `_fetching` may still name."""
        self._negative: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._closed = False
        keys = self._keys = peers.keyring()
        self.server: PeerServer | None = None
        self.fetcher: Fetcher | None = None
        self.advertised = _advertised(peers.listen) if peers.listen is not None else None
        try:
            if peers.listen is not None:
                self.server = PeerServer(
                    context=self._context,
                    listen=peers.listen,
                    keys=keys,
                    fingerprint=self.fingerprint,
                    local=local,
                    make_agent=lambda: self._agent("serve"),
                    spans=self._spans,
                    itemsize=self._itemsize,
                    lease_s=peers.lease_s,
                    handle_lease_s=peers.handle_lease_s,
                    counters=self.counters,
                )
                self.server.start()
            if ec_config.is_ec_consumer:
                self.fetcher = Fetcher(
                    context=self._context,
                    keys=keys,
                    fingerprint=self.fingerprint,
                    local=local,
                    make_agent=lambda: self._agent("fetch"),
                    spans=self._spans,
                    itemsize=self._itemsize,
                    counters=self.counters,
                    on_failed=self._note_failure,
                    embed_width=layout.embed_width,
                )
                self.fetcher.start()
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "EC CPU tier peers: wire %d, fingerprint %s, listen=%s peers=%s",
            WIRE_VERSION,
            self.fingerprint,
            self.advertised,
            ",".join(map(str, peers.peers)) or "-",
        )

    def _agent(self, role: str) -> RegionAgent:
        name = f"ec-cpu-{role}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        return RegionAgent(name, self._base, self._nbytes)

    def _spans(self, runs: tuple[tuple[int, int], ...], nbytes: int) -> list[Span]:
        """Where an entry of `nbytes` over `runs` lies in this process's mapping."""
        spans: list[Span] = []
        left = nbytes
        for first, count in runs:
            if left <= 0:
                break
            size = min(count * self._block, left)
            spans.append((self._base + first * self._block, size))
            left -= size
        return spans

    # ------------------------------------------------------------ consumer

    def wants(self, request: Request, missing: Sequence[Wanted]) -> bool:
        if self.fetcher is None or self._closed or not self.fetcher.running:
            return False  # no fetches (any more): nothing to wait for, items encode here
        task = self._tasks.get(request.request_id)
        features = len(request.mm_features)
        if task is not None and features > task.features:
            # A streaming-input session resumed with a chunk that added media (vLLM
            # keeps its request id): the new items are asked like a new request's.
            # The earlier chunk's task goes the way of a finished request's.
            del self._tasks[request.request_id]
            self._finished.append(task)
            task = None
        if task is not None:
            # Its own fetch is asked once; it also waits for the items other requests'
            # fetches bring (as on the first call), or it would encode them meanwhile.
            return not task.done or self._brought_by_others(missing, task)
        now = self.fetcher.clock()  # the deadlines below are read on the fetcher's clock
        waits = False  # on an item another request's fetch is bringing
        items: dict[str, ItemFetch] = {}
        for wanted in missing:
            other = self._fetching.get(wanted.key)
            if other is not None:
                if not other.done:
                    waits = True
                    continue
                del self._fetching[wanted.key]
            if self._local.state(wanted.key) != "missing":
                continue  # a save of it is under way here
            if not self._recently_failed(wanted.key, now):
                items[wanted.key] = ItemFetch(wanted)
        candidates = list(self._settings.peers)
        handle = self._handle(request) if items else None
        handle_peer = handle[0] if handle is not None else None
        if handle_peer is not None and handle_peer not in candidates:
            candidates.insert(0, handle_peer)
        if not candidates or not items:
            if items and handle is not None and handle_peer is None:
                # Encoded here because its handle names an incompatible engine: each
                # item counts once, and a done task keeps later calls from counting again.
                for _ in items:
                    self.counters.fell_back("incompatible")
                self._tasks[request.request_id] = FetchTask(
                    request.request_id, items, (), now, now, done=True, features=features
                )
            elif waits:
                # It waits only for other requests' fetches: a done task records it, so
                # once those are over it goes on (what did not land is encoded) instead
                # of fetching those items again and waiting a timeout more each time.
                self._tasks[request.request_id] = FetchTask(
                    request.request_id, {}, (), now, now, done=True, features=features
                )
            return waits
        task = FetchTask(
            request_id=request.request_id,
            items=items,
            candidates=tuple(candidates),
            lookup_deadline=now + self._settings.lookup_timeout_s,
            deadline=now + self._settings.fetch_timeout_s,
            handle=handle[1] if handle is not None else None,
            features=features,
        )
        self._tasks[request.request_id] = task
        for key in items:
            self._fetching[key] = task
        self.fetcher.submit(task)
        return True

    def _brought_by_others(self, missing: Sequence[Wanted], task: FetchTask) -> bool:
        """Whether another task than `task` is still fetching one of `missing`."""
        for wanted in missing:
            other = self._fetching.get(wanted.key)
            if other is not None and other is not task and not other.done:
                return True
        return False

    def step_done(self) -> None:
        if self._finished:
            self._forget_finished()
        if self.fetcher is not None and not self._closed:
            self.fetcher.kick()

    def _forget_finished(self) -> None:
        """Drop the items of finished requests' tasks that are done from `_fetching`
        (an aborted request's fetch may still run: it is kept until it is done)."""
        still: list[FetchTask] = []
        for task in self._finished:
            if not task.done:
                still.append(task)
                continue
            for key in task.items:
                if self._fetching.get(key) is task:
                    del self._fetching[key]
        self._finished = still

    def _handle(self, request: Request) -> tuple[PeerAddress | None, HandleLease | None] | None:
        """The producer a request's handle names, and its pre-granted lease if it
        carries one that is signed with the secret and not about to end; `(None, None)`
        if that producer's engine is incompatible with this one (not asked); None
        without a well-formed handle."""
        params = getattr(request, "ec_transfer_params", None)
        handle = params.get(HANDLE_KEY) if isinstance(params, dict) else params
        if handle is None:
            return None  # no handle in the request
        if not isinstance(handle, dict):  # e.g. forwarded as JSON text: said, or unseen
            self._warnings.warn("handle", "EC CPU tier: ignoring a malformed ec_transfer_params")
            return None
        try:
            peer = PeerAddress.parse("ec_transfer_params.peer", handle.get("peer"))
        except ValueError:
            self._warnings.warn("handle", "EC CPU tier: ignoring a malformed ec_transfer_params")
            return None
        if handle.get("fingerprint") != self.fingerprint:
            self._warnings.warn(
                f"handle-fp:{peer}",
                "EC CPU tier: ec_transfer_params name %s, whose engine is incompatible with "
                "this one (another model, dtype, width or wire version); encoding here",
                peer,
            )
            return None, None
        return peer, self._handle_lease(peer, handle)

    def _handle_lease(self, peer: PeerAddress, handle: dict[str, Any]) -> HandleLease | None:
        lease = handle.get("lease")
        if not isinstance(lease, dict):
            return None
        try:
            fields = _lease_fields(handle, lease)
            if not handle_signed(self._keys.accepted, fields, str(lease["sig"])):
                self._warnings.warn(
                    "handle-sig", "EC CPU tier: ignoring a handle lease not signed with the secret"
                )
                return None
            if time.time() > float(fields["issued"]) + float(fields["ttl"]) - HANDLE_TTL_MARGIN_S:
                return None  # (nearly) over: a plain lookup instead
            spans = {
                str(key): [(int(a), int(n)) for a, n in runs]
                for key, runs in fields["spans"].items()
            }
            shapes = {str(key): (int(r), int(c)) for key, (r, c) in fields["items"].items()}
            return HandleLease(
                peer=peer,
                lease=int(fields["id"]),
                agent=str(fields["agent"]),
                spans=spans,
                shapes=shapes,
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            self._warnings.warn("handle", "EC CPU tier: ignoring a malformed handle lease")
            return None

    def _recently_failed(self, key: str, now: float) -> bool:
        until = self._negative.get(key)
        if until is None:
            return False
        if until > now:
            return True
        self._negative.pop(key, None)
        return False

    def _note_failure(self, key: str, cause: str) -> None:
        """Fetcher thread: remember items no peer has, so they are not asked again at once."""
        assert self.fetcher is not None  # its only caller: the fetcher's `on_failed`
        if cause in NEGATIVE_CAUSES:
            self._negative[key] = self.fetcher.clock() + NEGATIVE_TTL_S
            while len(self._negative) > NEGATIVE_MAX:
                self._negative.popitem(last=False)

    # ------------------------------------------------------------ producer

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        task = self._tasks.pop(request.request_id, None)
        if task is not None:
            self._finished.append(task)
            self._forget_finished()
        if self.advertised is None:
            return None
        if getattr(request.status, "name", None) in DROPPED_STATUSES:
            # Nobody gets its handle: a lease would pin its entries, unclaimable, until
            # it expired (a burst of aborts could pin the whole region).
            return None
        items: dict[str, list[int]] = {}
        # By this engine's keys: a salted item's names only the salt's digest, so the
        # handle serves only requests of the same salt (`ec_scheduler.tenancy`).
        for key in self._local.item_keys(request):
            if self._local.state(key) == "missing":
                continue
            shape = self._local.shape(key)
            if shape is not None:
                items[key] = [shape[0], shape[1]]
        if not items:
            return None
        handle: dict[str, Any] = {
            "version": WIRE_VERSION,
            "peer": self.advertised,
            "fingerprint": self.fingerprint,
            "items": items,
        }
        if self.server is not None and self.server.handle_lease_s > 0:
            lease, spans = self.server.grant_handle({k: (r, c) for k, (r, c) in items.items()})
            if lease:
                granted: dict[str, Any] = {
                    "id": lease,
                    "agent": self.server.agent.name,
                    "spans": {key: [[a, n] for a, n in runs] for key, runs in spans.items()},
                    "issued": time.time(),
                    "ttl": self.server.handle_lease_s,
                }
                granted["sig"] = handle_signature(
                    self._keys.signing, _lease_fields(handle, granted)
                )
                handle["lease"] = granted
        return {HANDLE_KEY: handle}

    # --------------------------------------------------------------- misc

    def stat_totals(self) -> dict[str, float]:
        return self.counters.totals()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        threads_done = True
        if self.fetcher is not None:
            threads_done &= self.fetcher.stop()
        if self.server is not None:
            threads_done &= self.server.stop()
        self._local.closed = True
        if threads_done:
            self._context.term()
        quarantined = self.fetcher.quarantined if self.fetcher is not None else 0
        if threads_done and not quarantined:
            self._region.cleanup()
            return
        # A hung thread's NIXL agent may still READ into or serve from the region, and so
        # may a READ NIXL never released (quarantined): unmapped under it, the process
        # would crash. The mapping (and a hung thread's sockets, which term() would wait
        # for) stay until the process exits.
        logger.warning(
            "EC CPU tier: %s; the region's mapping is left to the process's exit",
            "a peer thread did not stop in time"
            if not threads_done
            else f"{quarantined} READ(s) NIXL never released",
        )


def _lease_fields(handle: dict[str, Any], lease: dict[str, Any]) -> dict[str, Any]:
    """What a handle lease's signature covers: everything a consumer acts on."""
    return {
        "peer": handle["peer"],
        "fingerprint": handle["fingerprint"],
        "items": handle["items"],
        "id": lease["id"],
        "agent": lease["agent"],
        "spans": lease["spans"],
        "issued": lease["issued"],
        "ttl": lease["ttl"],
    }


def _advertised(listen: PeerAddress) -> str:
    """The address other engines reach this one at (a wildcard bind names this host)."""
    if listen.host in ("0.0.0.0", "::", "*"):
        return str(PeerAddress(socket.getfqdn(), listen.port))
    return str(listen)
