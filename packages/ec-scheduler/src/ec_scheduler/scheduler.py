"""ECCPUScheduler: the scheduler-process half of the EC CPU tier.

It owns every decision: which encoder outputs to save into the region, which
entries to load back, when a copy has landed, and what to evict. It needs only
the region's geometry and never imports device code; the one process-level
exception (a NIXL source maps the region here to register it) is stated in
`tests/test_import_contracts.py`.

Runs in the scheduler process. `ECCPUScheduler` is a facade over vLLM's
connector hooks; the state behind them has one owner each:
  * `ec_scheduler.availability`: promises, stale entries, items without input;
  * `ec_scheduler.step_plan`: the copies of the step being scheduled;
  * `ec_scheduler.saves`: which computed items are saved, into which blocks;
  * `ec_scheduler.settlement`: the copies in flight and the workers' reports;
  * `ec_scheduler.connections`: the reservation file, report side channel
    and remote source (everything construction opens);
  * `ec_scheduler.tenancy`: the key each item's entry has (its identifier,
    or with vLLM's `cache_salt` the identifier wrapped with the salt's digest).
vLLM's call order is drawn once, in `ec_scheduler.shell.connector`; what each
call guarantees is on its method here.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from ec_core._vllm import get_logger
from ec_core.layout import RegionLayout, region_layout
from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_core.ratelimit import RateLimitedWarnings
from ec_core.scheduler_process.allocator import BlockAllocator, Entry
from ec_core.scheduler_process.policy import make_policy
from ec_core.stats import WORKER_COUNTERS, ECCPUConnectorStats
from ec_scheduler.access_log import AccessLog, open_access_log
from ec_scheduler.availability import Availability, num_embeds
from ec_scheduler.connections import Connections, log_configuration
from ec_scheduler.counters import SchedulerCounters
from ec_scheduler.flights import Flights, ReportBound
from ec_scheduler.inputs import ItemInputs
from ec_scheduler.publishing import StatsPublisher, stat_totals
from ec_scheduler.remote import LocalEntries, RemoteSource
from ec_scheduler.saves import Saves
from ec_scheduler.settlement import Settlement
from ec_scheduler.step_plan import StepPlan
from ec_scheduler.tenancy import TierKeys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(
    method: Callable[Concatenate[ECCPUScheduler, _P], _R],
) -> Callable[Concatenate[ECCPUScheduler, _P], _R]:
    """Run a method under the scheduler's lock (a remote source's threads share the state)."""

    def wrapper(self: ECCPUScheduler, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        lock = self.lock
        lock.acquire()  # (a `with` costs twice as much)
        try:
            return method(self, *args, **kwargs)
        finally:
            lock.release()

    functools.update_wrapper(wrapper, method)
    return wrapper


class ECCPUScheduler:
    """Bookkeeping and per-step decisions for one engine's region.

    Guarantees:
      * a lookup that answered True is loaded in that step, or its pin is
        released at the end of the step; it is never evicted in between;
      * no copy's blocks are reused while any rank may still read or write
        them (`Settlement`);
      * no item can crash `schedule()`: items that cannot be saved (too large,
        empty, unmeasured modality, region full) are skipped;
      * no item without input (metadata only, `ec_scheduler.inputs`) reaches the
        encoder: a request with one that neither vLLM's encoder cache, nor a
        ready entry here, nor a fetch can supply is failed (retryable) instead
        of crashing the model runner (`take_unavailable_requests`);
      * nothing waits forever: a copy unreported past the configured bound is
        counted and warned about and no longer keeps the engine stepping;
      * per-step work is proportional to the step's items and landed copies,
        never to the region's blocks or the number of cached entries;
      * a step's copies are planned in one `StepPlan`, handed to the workers
        once and replaced by a fresh one: nothing planned leaks into a later step;
      * every public method runs under `lock`, which a remote source's threads
        take too (through `LocalEntries`);
      * an entry saved or fetched for a request with `cache_salt` S is loaded or
        leased only for requests with salt S; unsalted requests share among
        themselves (with `ec_isolate_cache_salt` false, everyone shares). Every
        key of the allocator, the policy, a step's plan, a peer lookup and a
        handle is a tier key (`ec_scheduler.tenancy`), and `has_cache_item`,
        which vLLM asks without the request, answers only for the request
        `ensure_cache_available` was last called for in the step.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        layout: RegionLayout | None = None,
        *,
        follow_reservation: bool = False,
    ) -> None:
        """Build the in-memory state, then open what the configuration asks for
        (`Connections.open`; a failure there closes what it opened and raises).

        With `follow_reservation` (what the connector shell passes) the allocator
        hands out only blocks the region's creator has reserved so far
        (`ec_core.region.reservation`); without it (tests and tools that run no
        workers) the whole pool counts as reserved.
        """
        ec_config = vllm_config.ec_transfer_config
        if ec_config is None:
            raise ValueError("ECCPUScheduler needs an ec_transfer_config")
        self.layout = layout if layout is not None else region_layout(vllm_config)
        settings = self.layout.settings
        self.is_producer = bool(ec_config.is_ec_producer)
        self.is_consumer = bool(ec_config.is_ec_consumer)
        self._widths: dict[str, int] = dict(ec_config.mm_encoder_output_widths)
        self._itemsize = self.layout.dtype.itemsize
        self.counters = SchedulerCounters()
        self.tier_keys = TierKeys(
            isolating=settings.isolate_cache_salt,
            secret=settings.peers.secret if settings.peers is not None else None,
        )
        """Each item's key in this tier; K is fixed here, for the engine's life."""
        self._asking: Request | None = None
        """The request vLLM asks `has_cache_item` about: the one `ensure_cache_available`
        was last called for in this step (None: none yet)."""
        self._asking_suffix = ""
        """`tier_keys.suffix(_asking)`: what its identifiers get to make its keys."""
        self._asking_ids: frozenset[str] | None = None
        """The identifiers of `_asking`'s items (of several), built at its first lookup."""
        self.allocator = BlockAllocator(
            self.layout.num_blocks,
            make_policy(settings.policy, self.layout.num_blocks),
            on_evict=self._on_evict,
            reserved=0 if follow_reservation else None,
        )
        self._warn_once = RateLimitedWarnings(logger, period_s=math.inf).warn
        self._availability = Availability(
            self.allocator,
            self.counters,
            ItemInputs(vllm_config.model_config),
            self._widths,
            RateLimitedWarnings(logger).warn,
        )
        self._warn_now_and_then = RateLimitedWarnings(logger).warn
        self._saves = Saves(
            self.allocator,
            self.counters,
            self.layout,
            self._widths,
            counted_by_lookup=self.is_consumer,
        )
        self.settlement = Settlement(
            self.allocator,
            self.counters,
            ReportBound(settings.report_timeout_steps, settings.report_timeout_s),
            self._availability.release_pin,
        )
        # Only V2 calls the worker connector on steps without tokens; on V1 such
        # steps never reach the workers, so there is no point keeping the engine
        # stepping to collect reports (they come with the next real step).
        self._empty_steps_reach_workers = bool(getattr(vllm_config, "use_v2_model_runner", False))
        self._encode_only = self.is_producer and not self.is_consumer
        self._plan = StepPlan()
        self._step = 0
        self._worker_step = 0
        self._next_tid = 0
        self._shut_down = False
        self._worker_totals: dict[str, float] = dict.fromkeys(WORKER_COUNTERS, 0.0)
        self._publisher = StatsPublisher(vllm_config.parallel_config.data_parallel_index)
        self.lock = threading.RLock()
        self._connections = Connections()
        self._connections.open(
            vllm_config,
            self.layout,
            self.allocator,
            follow_reservation=follow_reservation,
            local_entries=self._local_entries,
        )
        self.remote: RemoteSource | None = self._connections.remote
        log_configuration(vllm_config, self.layout)
        self.access_log: AccessLog | None = None
        """The opt-in access log (`ec_access_log`): on a consumer only, where lookups are
        counted; it never raises into a step (`ec_scheduler.access_log`)."""
        if settings.access_log is not None:
            if self.is_consumer:
                self.access_log = open_access_log(
                    settings.access_log,
                    settings.access_log_max_bytes,
                    block_bytes=self.layout.block_size_bytes,
                    dp_index=vllm_config.parallel_config.data_parallel_index,
                )
            else:
                logger.warning(
                    "EC CPU tier: ec_access_log is set, but this engine (role %s) looks "
                    "nothing up, so there is nothing to log; no log is written",
                    ec_config.ec_role,
                )

    def _local_entries(self) -> LocalEntries:
        """This engine's entries as the remote source sees them."""
        availability = self._availability
        return LocalEntries(
            self.allocator,
            self.lock,
            availability.release_pin,
            availability.stale.__contains__,
            lambda rows, cols: self.layout.blocks_for(rows, cols, self._itemsize),
            refresh=self._apply_side_reports,
            item_keys=self.tier_keys.keys_of,
        )

    @property
    def vllm_holds(self) -> Callable[[Request, int, int], bool]:
        """Whether vLLM's own encoder cache holds item `index` of a request when it
        gets to it (`shell.own_cache.keeps`; the shell sets it)."""
        return self._availability.vllm_holds

    @vllm_holds.setter
    def vllm_holds(self, holds: Callable[[Request, int, int], bool]) -> None:
        self._availability.vllm_holds = holds

    # ------------------------------------------------------------ lookups

    def has_cache_item(self, identifier: str) -> bool:
        """True iff a ready entry of the item's tier key exists on a consumer
        (`Availability.promise`).

        vLLM asks by identifier alone. It calls `ensure_cache_available` for a
        request right before it looks up that request's items (vLLM's
        `Scheduler.schedule`: the running and the waiting loop each call it,
        through `_ec_transfer_pending` for the latter, before
        `_try_schedule_encoder_inputs`), so the identifier is resolved to a tier
        key through the request that call named (`_asking`). An identifier that
        request does not have (a vLLM that did not call it first) is a miss, with
        a rate-limited warning while isolating: the item is encoded again rather
        than risk another tenant's entry. With isolation off the identifier is
        the key, whatever the order.

        The entry is pinned on the spot (a *promise*): nothing allocated later in
        the step, a save of another item of the same request included, can evict
        it before its load is dispatched. `build_connector_meta` releases the
        promises vLLM did not take up.

        Nothing is counted here, and the policy hears no request (the pin protects
        the entry, `EvictionPolicy.on_held`; its release refreshes the entry's
        recency, as every release does): vLLM asks again every step while a request
        waits (for KV blocks, say), so an item is counted once, when vLLM schedules
        it (`update_state_after_alloc`).
        """
        # The hot methods take the lock inline rather than through `_locked`:
        # vLLM calls them once per item, and the wrapper's frame is a measurable
        # share of their cost. They acquire and release it rather than use `with`,
        # which costs twice as much in CPython (timeit: ~160 ns against ~80).
        lock = self.lock
        lock.acquire()
        try:
            if not self.is_consumer:
                return False
            key = self._key_asked(identifier) if self.tier_keys.isolating else identifier
            if key is None:
                return False
            return self._availability.promise(key, self._plan.loads)
        finally:
            lock.release()

    def _key_asked(self, identifier: str) -> str | None:
        """The tier key of `identifier` in the request vLLM is asking about, or None."""
        request = self._asking
        if request is not None:
            features = request.mm_features
            if len(features) == 1:  # the usual request: no set to build
                has = features[0].identifier == identifier
            else:
                ids = self._asking_ids
                if ids is None:
                    ids = self._asking_ids = frozenset(f.identifier for f in features)
                has = identifier in ids
            if has:
                suffix = self._asking_suffix
                return identifier + suffix if suffix else identifier
        self._warn_now_and_then(
            "unresolved",
            "EC CPU tier: vLLM looked up an item (%s) of a request it had not called "
            "ensure_cache_available for first; with ec_isolate_cache_salt the tier "
            "cannot tell that request's cache_salt, so the item is encoded instead",
            identifier,
        )
        return None

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """False while the request should wait for entries other engines are sending.

        vLLM calls this for a request before looking up its items, and
        `has_cache_item` relies on it: the request named here is the one whose
        `cache_salt` decides the keys of the lookups that follow. An entry
        whose stored row count differs from the item's embedding count (a
        client UUID reused for other content) is removed here, so the item is
        a miss instead of a silently wrong load. With a remote source, the
        items this engine does not hold are offered to it; without one, this
        defers only a request it has found unavailable.

        Unavailable: an item still to be encoded carries no input (metadata
        only) and neither vLLM's encoder cache nor a ready entry of its row
        count here holds it, and no fetch for it is in flight. The encoder
        cannot run on it, so the request waits (False) until
        `take_unavailable_requests` hands it to vLLM, which fails it.
        """
        lock = self.lock
        lock.acquire()
        try:
            # First, on every path: `has_cache_item` resolves the identifiers vLLM asks
            # about next through this request (see there).
            if request is not self._asking:
                self._asking = request
                self._asking_ids = None
                self._asking_suffix = self.tier_keys.suffix(request)
            if not self.is_consumer:
                return True
            return self._availability.ensure(
                request, num_computed_tokens, self.remote, self._asking_suffix
            )
        finally:
            lock.release()

    def take_unavailable_requests(self) -> set[str]:
        """The requests found unavailable since the last call (each once); vLLM fails
        them with a retryable error."""
        with self.lock:
            return self._availability.take_unavailable()

    # --------------------------------------------------------- allocation

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Turn a promised item into a load, or give a computed item a save.

        A load gets a fresh transfer id and the promise's pin (the same item in
        several requests of one step is loaded once). A save is sized from the
        modality's measured width and the item's embedding count, unless the item
        cannot be saved: larger than the region, no embeddings, or a modality
        without a measured width (one warning per kind), or a region full of held
        entries (counted). Never raises for an item.

        On a consumer, this is where an item vLLM's own cache lacked is counted (a
        lookup, and a hit when it is loaded), told to the policy and, with
        `ec_access_log`, queued for the access log: once per item vLLM schedules,
        however many steps its request waited before.
        """
        lock = self.lock
        lock.acquire()
        try:
            if self._shut_down:
                return
            feature = request.mm_features[index]
            identifier = feature.identifier
            # (vLLM allocates the items of the request it last asked about.)
            suffix = (
                self._asking_suffix if request is self._asking else self.tier_keys.suffix(request)
            )
            key = identifier + suffix if suffix else identifier
            plan = self._plan
            if key in plan.loads:
                # the same item of another request in this step: one load serves both
                plan.takers.setdefault(key, []).append(request.request_id)
                return
            if self.is_consumer:
                counters = self.counters
                counters.lookups += 1
                allocator = self.allocator
                entry = allocator.get(key)  # `note_request`, inline: the hot path
                allocator.policy.on_request(key, entry is not None and entry.ready)
                access_log = self.access_log
                if access_log is not None:
                    rows = num_embeds(feature.mm_position)
                    width = self._widths.get(feature.modality, self.layout.embed_width)
                    access_log.record(key, rows, rows * width * self._itemsize)
                if key in self._availability.promised:
                    counters.hits += 1
                    self._dispatch_load(key, identifier)
                    plan.takers[key] = [request.request_id]
                    return
            if self.is_producer and key not in self.allocator:
                self._saves.allocate(feature, plan, key)
        finally:
            lock.release()

    def _dispatch_load(self, key: str, identifier: str) -> None:
        entry = self.allocator.get(key)
        assert entry is not None and entry.shape is not None, "a promised entry is pinned"
        self._availability.take_promise(key)
        tid = self._next_tid
        self._next_tid += 1
        shape = entry.shape
        self._plan.add_load(
            key, tid, self.allocator.block_ids(entry), shape, entry.runs, identifier=identifier
        )
        counters = self.counters
        counters.loads_dispatched += 1
        counters.load_rows += shape[0]
        counters.load_bytes += shape[0] * shape[1] * self._itemsize

    @property
    def flights(self) -> Flights:
        """The copies in flight (read-only use: tests and diagnostics)."""
        return self.settlement.flights

    # ---------------------------------------------------------- step edge

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECCPUConnectorMetadata:
        """Hand this step's plan to the workers and start the next step's.

        The metadata carries the step's number and each save's shape; promises
        vLLM did not take up are released, and copies past the report bound are
        marked overdue.

        After a step that deferred a request, and outside the lock, this tells
        the remote source the step is over (it starts the step's fetches
        together: one message per peer) and yields the GIL once: while requests
        wait, vLLM runs empty steps back to back and would hold the GIL for the
        switch interval (5 ms) at a time, so the source's thread would progress
        its fetches only every few milliseconds.
        """
        meta = self._build_connector_meta(scheduler_output)
        availability = self._availability
        if availability.deferred and self.remote is not None:
            availability.deferred = False
            self.remote.step_done()
            time.sleep(0)  # let the remote source's threads take the GIL
        return meta

    @_locked
    def _build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECCPUConnectorMetadata:
        connections = self._connections
        if connections.reservation is not None:
            connections.follow_reservation(self.allocator)
        if connections.side_reports is not None:
            self._apply_side_reports()
        self._step += 1
        if self._reaches_workers(scheduler_output):
            self._worker_step += 1
        if self._availability.promised:
            self._availability.release_promises()
        self._asking = self._asking_ids = None  # the next step's lookups name their request anew
        plan, self._plan = self._plan, StepPlan()
        if plan.loads and scheduler_output.free_encoder_mm_hashes:
            self._withdraw_dropped_loads(plan, scheduler_output)
        meta = plan.hand_over(self._step)
        self.settlement.start_step(meta, self._worker_step)
        self.settlement.on_worker_step(self._worker_step)
        return meta

    def _withdraw_dropped_loads(self, plan: StepPlan, scheduler_output: SchedulerOutput) -> None:
        """Take back the loads `StepPlan.withdraw_untaken` removes, as if vLLM had never
        scheduled them: their pins and their counts."""
        withdrawn = plan.withdraw_untaken(
            scheduler_output.free_encoder_mm_hashes, scheduler_output.num_scheduled_tokens
        )
        counters = self.counters
        for key, (rows, cols) in withdrawn:
            self._availability.release_pin(key)
            counters.lookups -= 1
            counters.hits -= 1
            counters.loads_dispatched -= 1
            counters.load_rows -= rows
            counters.load_bytes -= rows * cols * self._itemsize

    def _reaches_workers(self, scheduler_output: SchedulerOutput) -> bool:
        return (
            self._empty_steps_reach_workers
            or self._encode_only
            or scheduler_output.total_num_scheduled_tokens > 0
        )

    # ------------------------------------------------------------ reports

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        """Apply the workers' reports (see `Settlement`); anything else is ignored."""
        report = connector_output.ec_connector_worker_meta
        if report is None:
            return
        lock = self.lock
        lock.acquire()
        try:
            if self._shut_down:
                return
            if not isinstance(report, ECCPUWorkerReport):
                self.counters.reports_ignored += 1
                self._warn_once(
                    f"foreign-report:{type(report).__qualname__}",
                    "EC CPU tier: ignoring a worker report of type %s (expected ECCPUWorkerReport)",
                    type(report).__qualname__,
                )
                return
            self._apply(report)
        finally:
            lock.release()

    def _apply(self, report: ECCPUWorkerReport) -> None:
        totals = self._worker_totals
        for name, value in report.stats.items():
            if name in totals:  # the worker counters; anything else is not summed
                totals[name] += value
        self.settlement.apply(report)
        availability = self._availability
        if availability.stale:
            availability.drop_free_stale()

    @_locked
    def invalidate(self) -> None:
        """Forget every entry: they hold encoder outputs of the model's weights before
        vLLM reset its encoder cache (a weight update; `shell.vllm_patches`).

        Ready, unpinned entries are dropped at once. An entry still in use (pinned
        by a load or a peer's lease, or not ready: a save or a fetch in flight) is
        marked stale: from now on it is never loaded or served, and it is dropped
        as soon as nothing holds it (its last pin, or the report of its copy).
        """
        if not self._shut_down:
            self._availability.invalidate()

    @_locked
    def _apply_side_reports(self) -> None:
        """Apply the reports that came on the side channel (encode-only engines on V1,
        see `ec_core.report_channel`)."""
        side_reports = self._connections.side_reports
        if side_reports is not None and not self._shut_down:
            for report in side_reports.drain():
                self._apply(report)

    # ------------------------------------------------------- misc. hooks

    @_locked
    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Never delays freeing; with a remote source, handles to this engine's entries
        of the request (vLLM returns them as the output's `ec_transfer_params`)."""
        if self.remote is None or self._shut_down:
            return False, None
        return False, self.remote.request_finished(request)

    @_locked
    def has_pending_push_work(self) -> bool:
        """True while a copy awaits its report and empty steps can collect it.

        A pure query (vLLM asks several times per iteration). On the V1 runner
        empty steps never reach the workers, so it stays False there: the
        engine may idle and the report arrives with the next real step. A
        copy past the report bound no longer counts, so the engine can idle.
        """
        return self._empty_steps_reach_workers and self.settlement.awaiting_reports

    @_locked
    def stat_totals(self) -> dict[str, float]:
        """Cumulative counters (stats names) and current gauges of this engine."""
        totals = stat_totals(self.counters, self.allocator, self._worker_totals)
        if self.remote is not None:
            totals.update(self.remote.stat_totals())
        return totals

    @_locked
    def get_ec_connector_stats(self) -> ECCPUConnectorStats | None:
        """What changed since the previous call (counter deltas) and the gauges.

        None when no counter moved, so idle steps cost vLLM nothing.
        """
        return self._publisher.changes(self.stat_totals())

    def _on_evict(self, entry: Entry) -> None:
        self.counters.evictions += 1
        self.counters.evicted_blocks += entry.num_blocks

    def shutdown(self) -> None:
        """Forget all state and stop answering hits; the access log is written out and
        closed. Idempotent."""
        with self.lock:
            if self._shut_down:
                return
            self._shut_down = True
            remote = self.remote
            access_log, self.access_log = self.access_log, None
        if access_log is not None:
            access_log.close()  # joins its writer: outside the lock
        if remote is not None:
            # Stops its threads before the state goes, outside the lock: they give
            # their leases and reservations back through `LocalEntries`, which takes
            # it, and would otherwise wait until the source gives up joining them.
            remote.shutdown()
        with self.lock:
            self._connections.close_files()
            self.is_producer = self.is_consumer = False
            self._plan = StepPlan()
            self._asking = self._asking_ids = None
            self._availability.clear()
            self.settlement.clear()
            self.allocator.clear()
