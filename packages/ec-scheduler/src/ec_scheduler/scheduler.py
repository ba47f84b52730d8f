"""ECCPUScheduler: the scheduler-process half of the EC CPU tier.

It owns every decision: which encoder outputs to save into the region, which
entries to load back, when a copy has landed, and what to evict. It never maps
the region (it needs only the geometry) and never imports device code.

Runs in the scheduler process. vLLM's call order is drawn once, in
`ec_scheduler.shell.connector`; what each call guarantees is on its method
here, and what the workers' reports do is in `ec_scheduler.settlement`.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from ec_core import report_channel
from ec_core._vllm import get_logger
from ec_core.layout import RegionLayout, region_layout
from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_core.ratelimit import RateLimitedWarnings
from ec_core.region.reservation import RegionReservation
from ec_core.report_channel import ReportReceiver
from ec_core.scheduler_process.allocator import BlockAllocator, Entry
from ec_core.scheduler_process.policy import make_policy
from ec_core.sizes import format_bytes
from ec_core.stats import WORKER_COUNTERS, ECCPUConnectorStats
from ec_scheduler.counters import SchedulerCounters
from ec_scheduler.flights import Flights, ReportBound
from ec_scheduler.inputs import ItemInputs
from ec_scheduler.publishing import StatsPublisher, stat_totals
from ec_scheduler.remote import (
    ANY_WIDTH,
    LocalEntries,
    RemoteSource,
    Wanted,
    load_remote_source,
)
from ec_scheduler.settlement import Settlement

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)

_RESERVATION_POLL_S = 0.005
"""How often a step looks at the region's reservation watermark while it moves."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(
    method: Callable[Concatenate[ECCPUScheduler, _P], _R],
) -> Callable[Concatenate[ECCPUScheduler, _P], _R]:
    """Run a method under the scheduler's lock (a remote source's threads share the state)."""

    def wrapper(self: ECCPUScheduler, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self.lock:
            return method(self, *args, **kwargs)

    functools.update_wrapper(wrapper, method)
    return wrapper


def _holds_nothing(request: Request, index: int, num_computed_tokens: int) -> bool:
    return False


def _num_embeds(position: PlaceholderRange) -> int:
    """`position.get_num_embeds()`, without building its cached cumulative sum when
    every placeholder token is an embedding (`is_embed` None): the engine core's
    request objects arrive without it, and this runs before vLLM computes it."""
    return position.length if position.is_embed is None else position.get_num_embeds()


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
      * every public method runs under `lock`, which a remote source's threads
        take too (through `LocalEntries`).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        layout: RegionLayout | None = None,
        *,
        follow_reservation: bool = False,
    ) -> None:
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
        self.allocator = BlockAllocator(
            self.layout.num_blocks,
            make_policy(settings.policy, self.layout.num_blocks),
            on_evict=self._on_evict,
            reserved=0 if follow_reservation else None,
        )
        # With follow_reservation (what the connector shell passes) the allocator
        # hands out only blocks the region's creator has reserved so far
        # (`ec_core.region.reservation`); without it (tests and tools that run
        # no workers) the whole pool counts as reserved.
        self._reservation: RegionReservation | None = None
        self._reservation_due = 0.0
        if follow_reservation:
            self._reservation = RegionReservation(
                self.layout.path,
                self.layout.num_blocks,
                self.layout.block_size_bytes,
                engine_id=self.layout.engine_id,
                owner=self.layout.owner,
            )
            self._follow_reservation()
        self.settlement = Settlement(
            self.allocator,
            self.counters,
            ReportBound(settings.report_timeout_steps, settings.report_timeout_s),
            self._release_pin,
        )

        # Only V2 calls the worker connector on steps without tokens; on V1 such
        # steps never reach the workers, so there is no point keeping the engine
        # stepping to collect reports (they come with the next real step).
        self._empty_steps_reach_workers = bool(getattr(vllm_config, "use_v2_model_runner", False))
        self._encode_only = self.is_producer and not self.is_consumer

        self._pending_saves: dict[str, list[int]] = {}
        self._pending_shapes: dict[str, tuple[int, int]] = {}
        self._pending_loads: dict[str, tuple[int, list[int], tuple[int, int]]] = {}
        self._pending_runs: dict[str, tuple[tuple[int, int], ...]] = {}
        self._load_takers: dict[str, list[str]] = {}
        """The requests each of this step's loads is for."""
        self._promised: set[str] = set()
        self._stale: set[str] = set()
        self._unavailable: set[str] = set()
        """Requests with an item no one can supply, until `take_unavailable_requests`."""
        self._inputs = ItemInputs(vllm_config.model_config)
        self.vllm_holds: Callable[[Request, int, int], bool] = _holds_nothing
        """Whether vLLM's own encoder cache holds item `index` of a request when it
        gets to it (`shell.own_cache.keeps`; the shell sets it)."""
        self._step = 0
        self._worker_step = 0
        self._next_tid = 0
        self._warn_once = RateLimitedWarnings(logger, period_s=math.inf).warn
        self._warn_now_and_then = RateLimitedWarnings(logger).warn
        self._shut_down = False
        self._deferred = False
        """A request was deferred since the last build_connector_meta (see there)."""
        self._worker_totals: dict[str, float] = dict.fromkeys(WORKER_COUNTERS, 0.0)
        self._publisher = StatsPublisher(vllm_config.parallel_config.data_parallel_index)
        self.lock = threading.RLock()
        self.remote: RemoteSource | None = None
        self._side_reports: ReportReceiver | None = None
        serves = settings.peers is not None and settings.peers.listen is not None
        if settings.peers is not None:
            try:
                if report_channel.needed(vllm_config, listening=serves):
                    self._side_reports = ReportReceiver(
                        report_channel.endpoint(self.layout.path), settings.peers.secret.encode()
                    )
                local = LocalEntries(
                    self.allocator,
                    self.lock,
                    self._release_pin,
                    self._stale.__contains__,
                    lambda rows, cols: self.layout.blocks_for(rows, cols, self._itemsize),
                    refresh=self._apply_side_reports,
                )
                self.remote = load_remote_source(vllm_config, self.layout, local)
            except BaseException:
                # A failed construction (the peer port in use, NIXL missing or failing)
                # releases what it opened: left to the garbage collector, the side
                # channel's ZMQ context may go before its socket, and its term() then
                # waits for that socket for ever (the process hangs); until then the
                # channel's address stays bound, and building again fails.
                self._close_files()
                raise

        if not serves and report_channel.drops_reports(vllm_config):
            logger.warning(
                "EC CPU tier role ec_producer without ec_peer_listen: on vLLM's V1 model "
                "runner an encode-only engine never reports its copies, so its entries "
                "never become ready and serve no one. Set ec_peer_listen (and a secret) "
                "to serve consumer engines, or use ec_both for a local CPU tier."
            )
        if self.is_consumer and not self.is_producer and settings.peers is None:
            logger.warning(
                "EC CPU tier role ec_consumer: this engine never saves, and its region "
                "belongs to this engine alone, so nothing will ever be loaded. Use "
                "ec_both for a local CPU tier, or ec_peers to fetch from producers."
            )
        logger.debug(
            "EC CPU tier scheduler: role=%s, %d blocks x %d bytes (%s), policy=%s, "
            "report bound=%d steps and %.1f s",
            ec_config.ec_role,
            self.layout.num_blocks,
            self.layout.block_size_bytes,
            format_bytes(self.layout.nbytes),
            settings.policy,
            settings.report_timeout_steps,
            settings.report_timeout_s,
        )

    # ------------------------------------------------------------ lookups

    def has_cache_item(self, identifier: str) -> bool:
        """True iff a ready entry exists on a consumer.

        The entry is pinned on the spot (a *promise*): nothing allocated later in
        the step, a save of another item of the same request included, can evict
        it before its load is dispatched. `build_connector_meta` releases the
        promises vLLM did not take up.

        Nothing is counted here, and the policy is not told: vLLM asks again every
        step while a request waits (for KV blocks, say), so an item is counted once,
        when vLLM schedules it (`update_state_after_alloc`).
        """
        # The hot methods take the lock inline rather than through `_locked`:
        # vLLM calls them once per item, and the wrapper's frame is a measurable
        # share of their cost.
        with self.lock:
            if not self.is_consumer or identifier in self._stale:
                # A stale entry holds another item under this UUID: even a load of it
                # dispatched this step (for a request vLLM then preempted, dropping
                # the item from its own cache and so from its row-count check) would
                # serve the other item's rows.
                return False
            if identifier in self._promised or identifier in self._pending_loads:
                return True
            allocator = self.allocator
            entry = allocator.get(identifier)
            if entry is None or not entry.ready:
                return False
            # The promise: pinned now, so an allocation later in this step cannot
            # evict it before update_state_after_alloc dispatches the load.
            allocator.pin_entry(entry)
            self._promised.add(identifier)
            return True

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """False while the request should wait for entries other engines are sending.

        vLLM calls this for a request before looking up its items. An entry
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
        with self.lock:
            if not self.is_consumer:
                return True
            if request.request_id in self._unavailable:
                return False
            if self.remote is None:
                if self._retire_stale_of(request, num_computed_tokens):
                    return True  # every item carries its input
            elif not self._ask_remote(request, num_computed_tokens, self.remote):
                return False
            return self._all_supplied(request, num_computed_tokens)

    def _all_supplied(self, request: Request, num_computed_tokens: int) -> bool:
        """False, with the request marked unavailable, if one of its items still to be
        encoded carries no input and nothing holds it (see `ensure_cache_available`).

        An item with input (nearly every item) costs one test here: the rest only
        runs for items without input."""
        carries_input = self._inputs.carries_input
        for index, feature in enumerate(request.mm_features):
            if carries_input(feature):
                continue
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # already consumed by the model; will not be looked up
            key = feature.identifier
            entry = self.allocator.get(key)
            if (
                entry is not None
                and entry.ready
                and entry.shape is not None
                and entry.shape[0] == _num_embeds(position)
                and key not in self._stale
            ):
                if key not in self._promised:
                    # Promised now, as `has_cache_item` would: between this check and
                    # vLLM's lookup the fetcher thread may reserve blocks, evicting it,
                    # and an item without input must not reach the encoder.
                    self.allocator.pin_entry(entry)
                    self._promised.add(key)
                continue
            if self.vllm_holds(request, index, num_computed_tokens):
                continue
            self._unavailable.add(request.request_id)
            self._warn_now_and_then(
                "unavailable",
                "EC CPU tier: request %s has a %s item %s given without its input "
                "(metadata only), and no engine holds its encoder output; the "
                "request is failed (send its input, or retry once a producer has it)",
                request.request_id,
                feature.modality,
                key,
            )
            return False
        return True

    def take_unavailable_requests(self) -> set[str]:
        """The requests found unavailable since the last call (each once); vLLM fails
        them with a retryable error."""
        with self.lock:
            if not self._unavailable:
                return set()
            taken, self._unavailable = self._unavailable, set()
            return taken

    def _retire_stale_of(self, request: Request, num_computed_tokens: int) -> bool:
        """Without a remote source: retire the request's stale entries; whether every
        item carries its input (else `_all_supplied` must look further; one loop for
        both in the usual case)."""
        entries = self.allocator.get
        carries_input = self._inputs.carries_input
        plain = self._inputs.plain
        all_carry = True
        for feature in request.mm_features:
            # `carries_input`, with its usual answer inline: this runs for every item.
            if all_carry and not (feature.modality in plain and feature.data):
                all_carry = carries_input(feature)
            entry = entries(feature.identifier)
            if entry is None:
                continue
            position = feature.mm_position
            if num_computed_tokens and position.offset + position.length <= num_computed_tokens:
                continue  # already consumed by the model; will not be looked up
            self._holds(entry, _num_embeds(position), request.request_id)
        return all_carry

    def _ask_remote(self, request: Request, num_computed_tokens: int, remote: RemoteSource) -> bool:
        """With a remote source: retire stale entries and offer it what is missing."""
        entries = self.allocator.get
        missing: list[Wanted] = []
        for feature in request.mm_features:
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # already consumed by the model; will not be looked up
            entry = entries(feature.identifier)
            rows = _num_embeds(position)
            if entry is not None and self._holds(entry, rows, request.request_id):
                continue
            if rows > 0:  # absent, or not ready yet: its save or fetch is under way
                # In the width a save of it has (a producer's entries have their
                # modality's measured width, wider than the embedding for DeepStack
                # encoders). vLLM measures widths on producers only, so a pure
                # consumer asks for any width and takes the peer's (`Wanted`).
                cols = self._widths.get(feature.modality, ANY_WIDTH)
                missing.append(Wanted(feature.identifier, rows, cols))
        # Asked even with nothing missing: items being fetched for this request are
        # reserved here (not ready), and the request waits until they land.
        if remote.wants(request, missing):
            self._deferred = True
            return False
        return True

    def _holds(self, entry: Entry, rows: int, request_id: str) -> bool:
        """True if `entry` is ready and holds exactly `rows` rows. A ready entry
        with another row count is stale: it is retired here (once: an entry
        already retired and still pinned is not counted again) and False returned."""
        if not entry.ready or entry.shape is None:
            return False
        if entry.shape[0] == rows:
            return True
        if entry.key not in self._stale:
            self._retire_stale(entry, rows, request_id)
        return False

    def _retire_stale(self, entry: Entry, rows: int, request_id: str) -> None:
        self._warn_now_and_then(
            "stale",
            "EC CPU tier: entry %s holds %d rows but request %s needs %d for that "
            "item (reused multimodal UUID?); dropping it and encoding again",
            entry.key,
            entry.shape[0] if entry.shape else -1,
            request_id,
            rows,
        )
        self.counters.stale_dropped += 1
        if entry.key in self._promised:
            # Promised to a request looked up earlier in this step that vLLM then
            # passed over (it allocates a request's items before it looks at the
            # next request): kept, the promise would answer this request's lookup
            # and load the other rows for it.
            self._promised.discard(entry.key)
            self.allocator.unpin(entry.key)
        if entry.evictable:
            self.allocator.drop(entry.key)
        else:
            # Pinned by a load in flight: never promise it again, drop it when
            # the last pin goes.
            self._stale.add(entry.key)

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
        lookup, and a hit when it is loaded) and told to the policy: once per item
        vLLM schedules, however many steps its request waited before.
        """
        with self.lock:
            if self._shut_down:
                return
            feature = request.mm_features[index]
            key = feature.identifier
            if key in self._pending_loads:
                # the same item of another request in this step: one load serves both
                self._load_takers.setdefault(key, []).append(request.request_id)
                return
            if self.is_consumer:
                counters = self.counters
                counters.lookups += 1
                self.allocator.policy.on_request(key)  # `note_request`
                if key in self._promised:
                    counters.hits += 1
                    self._dispatch_load(key)
                    self._load_takers[key] = [request.request_id]
                    return
            if self.is_producer and key not in self.allocator:
                self._allocate_save(feature)

    def _dispatch_load(self, key: str) -> None:
        entry = self.allocator.get(key)
        assert entry is not None and entry.shape is not None, "a promised entry is pinned"
        self._promised.discard(key)  # its pin now belongs to the load
        tid = self._next_tid
        self._next_tid += 1
        shape = entry.shape
        self._pending_loads[key] = (tid, self.allocator.block_ids(entry), shape)
        self._pending_runs[key] = entry.runs
        counters = self.counters
        counters.loads_dispatched += 1
        counters.load_rows += shape[0]
        counters.load_bytes += shape[0] * shape[1] * self._itemsize

    @property
    def flights(self) -> Flights:
        """The copies in flight (read-only use: tests and diagnostics)."""
        return self.settlement.flights

    def _allocate_save(self, feature: MultiModalFeatureSpec) -> None:
        key = feature.identifier
        width = self._widths.get(feature.modality)
        if width is None:
            self.counters.saves_skipped_unmeasured += 1
            self._warn_once(
                f"unmeasured:{feature.modality}",
                "EC CPU tier: no encoder output width was measured for modality %r "
                "(measured: %s); its items are not saved",
                feature.modality,
                sorted(self._widths),
            )
            return
        rows = _num_embeds(feature.mm_position)
        if rows <= 0:
            self.counters.saves_skipped_empty += 1
            self._warn_once(
                f"empty:{feature.modality}",
                "EC CPU tier: a %s item with no embeddings is not saved",
                feature.modality,
            )
            return
        blocks = self.layout.blocks_for(rows, width, self._itemsize)
        if blocks > self.layout.num_blocks:
            self.counters.saves_skipped_oversize += 1
            self._warn_once(
                f"oversize:{feature.modality}",
                "EC CPU tier: a %s item of %d x %d needs %d blocks but the region has "
                "%d; such items are not saved (raise ec_cpu_bytes to keep them)",
                feature.modality,
                rows,
                width,
                blocks,
                self.layout.num_blocks,
            )
            return
        if not self.is_consumer:
            self.allocator.note_request(key)  # a consumer counted it in update_state_after_alloc
        entry = self.allocator.alloc(key, blocks, (rows, width))
        if entry is None:
            if self.allocator.last_refusal == "admission":
                self.counters.saves_not_admitted += 1
            else:
                self.counters.saves_skipped_full += 1
            return
        self._pending_saves[key] = self.allocator.block_ids(entry)
        self._pending_shapes[key] = (rows, width)
        self._pending_runs[key] = entry.runs
        counters = self.counters
        counters.saves_dispatched += 1
        counters.save_rows += rows
        counters.save_bytes += rows * width * self._itemsize

    # ---------------------------------------------------------- step edge

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECCPUConnectorMetadata:
        """Hand this step's saves and loads to the workers and reset them.

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
        if self._deferred and self.remote is not None:
            self._deferred = False
            self.remote.step_done()
            time.sleep(0)  # let the remote source's threads take the GIL
        return meta

    @_locked
    def _build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECCPUConnectorMetadata:
        if self._reservation is not None:
            self._follow_reservation()
        self._apply_side_reports()
        self._step += 1
        if self._reaches_workers(scheduler_output):
            self._worker_step += 1
        for key in self._promised:
            self._release_pin(key)  # vLLM looked it up but did not schedule it
        self._promised.clear()
        if self._pending_loads and scheduler_output.free_encoder_mm_hashes:
            self._withdraw_dropped_loads(scheduler_output)
        self._load_takers = {}
        meta = ECCPUConnectorMetadata(
            saves=self._pending_saves,
            loads=self._pending_loads,
            step=self._step,
            save_shapes=self._pending_shapes,
            runs=self._pending_runs,
        )
        self.settlement.start_step(meta, self._worker_step)
        self._pending_saves = {}
        self._pending_shapes = {}
        self._pending_loads = {}
        self._pending_runs = {}
        self.settlement.on_worker_step(self._worker_step)
        return meta

    def _withdraw_dropped_loads(self, scheduler_output: SchedulerOutput) -> None:
        """Take back the loads of this step whose item vLLM freed in the same step
        and that no request scheduled in the step is for, as if vLLM had never
        scheduled them.

        Priority scheduling can preempt a request after its items were allocated
        (its load dispatched), and a later allocation of the step can then evict
        the item from vLLM's encoder cache. The workers drop the step's freed items
        before they load: landed, the load would sit in their encoder cache
        untracked (device memory vLLM never frees, unless a later request brings
        the same item back). A load that a scheduled request takes is kept even if
        its item is named (vLLM's encoder cache manager names only items it no
        longer holds at the step's end; the encoder-decoder one names the items of
        the step before, which a request of this step may load again).
        """
        scheduled = scheduler_output.num_scheduled_tokens
        for key in scheduler_output.free_encoder_mm_hashes:
            takers = self._load_takers.get(key)
            if takers is None or key not in self._pending_loads:
                continue
            if any(request_id in scheduled for request_id in takers):
                continue
            _, _, shape = self._pending_loads.pop(key)
            self._pending_runs.pop(key, None)
            self._release_pin(key)
            counters = self.counters
            counters.lookups -= 1
            counters.hits -= 1
            counters.loads_dispatched -= 1
            counters.load_rows -= shape[0]
            counters.load_bytes -= shape[0] * shape[1] * self._itemsize

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
        with self.lock:
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

    def _apply(self, report: ECCPUWorkerReport) -> None:
        totals = self._worker_totals
        for name, value in report.stats.items():
            if name in totals:  # the worker counters; anything else is not summed
                totals[name] += value
        self.settlement.apply(report)
        if self._stale:
            self._drop_free_stale()

    def _drop_free_stale(self) -> None:
        """Drop the stale entries nothing holds any more (a save or fetch marked stale
        by `invalidate` that has since landed), and forget stale keys that are gone."""
        allocator = self.allocator
        free = [key for key in self._stale if (e := allocator.get(key)) is None or e.evictable]
        for key in free:
            self._stale.discard(key)
            if key in allocator:
                allocator.drop(key)

    @_locked
    def invalidate(self) -> None:
        """Forget every entry: they hold encoder outputs of the model's weights before
        vLLM reset its encoder cache (a weight update; `shell.weight_updates`).

        Ready, unpinned entries are dropped at once. An entry still in use (pinned
        by a load or a peer's lease, or not ready: a save or a fetch in flight) is
        marked stale: from now on it is never loaded or served, and it is dropped
        as soon as nothing holds it (its last pin, or the report of its copy).
        """
        if self._shut_down:
            return
        for key in self._promised:
            self._release_pin(key)
        self._promised.clear()
        allocator = self.allocator
        entries = list(allocator)
        held = 0
        for entry in entries:
            if entry.evictable:
                allocator.drop(entry.key)
            else:
                self._stale.add(entry.key)
                held += 1
        logger.info(
            "EC CPU tier: vLLM reset its encoder cache (model weights changed): %d entries "
            "dropped, %d more once their copies end",
            len(entries) - held,
            held,
        )

    @_locked
    def _apply_side_reports(self) -> None:
        """Apply the reports that came on the side channel (encode-only engines on V1,
        see `ec_core.report_channel`)."""
        if self._side_reports is not None and not self._shut_down:
            for report in self._side_reports.drain():
                self._apply(report)

    def _release_pin(self, key: str) -> None:
        entry = self.allocator.unpin(key)
        if entry.pins == 0 and key in self._stale:
            self._stale.discard(key)
            self.allocator.drop(key)

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

    def _follow_reservation(self) -> None:
        """Give the allocator the blocks reserved since the last look (at most every
        `_RESERVATION_POLL_S`); stop looking once the watermark is final."""
        reservation = self._reservation
        now = time.monotonic()
        if reservation is None or now < self._reservation_due:
            return
        self._reservation_due = now + _RESERVATION_POLL_S
        self.allocator.extend_reserved(reservation.poll())
        if reservation.final:
            self._reservation = None

    def _on_evict(self, entry: Entry) -> None:
        self.counters.evictions += 1
        self.counters.evicted_blocks += entry.num_blocks

    def shutdown(self) -> None:
        """Forget all state and stop answering hits. Idempotent."""
        with self.lock:
            if self._shut_down:
                return
            self._shut_down = True
            remote = self.remote
        if remote is not None:
            # Stops its threads before the state goes, outside the lock: they give
            # their leases and reservations back through `LocalEntries`, which takes
            # it, and would otherwise wait until the source gives up joining them.
            remote.shutdown()
        with self.lock:
            self._clear_after_shutdown()

    def _close_files(self) -> None:
        """Close the side channel and the reservation's file (idempotent)."""
        if self._side_reports is not None:
            self._side_reports.close()
            self._side_reports = None
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None

    def _clear_after_shutdown(self) -> None:
        self._close_files()
        self.is_producer = self.is_consumer = False
        self._pending_saves = {}
        self._pending_shapes = {}
        self._pending_loads = {}
        self._pending_runs = {}
        self._load_takers = {}
        self._promised.clear()
        self._stale.clear()
        self._unavailable.clear()
        self.settlement.clear()
        self.allocator.clear()
