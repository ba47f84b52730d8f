"""Applying the workers' reports: when a copy's blocks may be used again.

Runs in the scheduler process. `Settlement` owns the copies in flight and
the ranks' progress; the scheduler hands it each dispatched copy and each
report, and calls `on_worker_step` once per step that reaches the workers.
"""

from __future__ import annotations

from collections.abc import Callable

from ec_core._vllm import get_logger
from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_core.ratelimit import RateLimitedWarnings
from ec_core.scheduler_process.allocator import BlockAllocator
from ec_scheduler.counters import SchedulerCounters
from ec_scheduler.flights import Flights, LoadFlight, Ranks, ReportBound

logger = get_logger(__name__)


class Settlement:
    """Turns reports into ready entries and released pins, and nothing else does.

    INVARIANT (block reuse). A copy's blocks go back to the allocator — a
    save's not-ready entry discarded, a load's pin released — only when the
    copy can no longer touch them:
      (a) its own report arrived (a load: from every live rank, once every
          rank the workers announced has been heard from or given up on), or
      (b) every live rank reported settling at or past the copy's step (its
          report was lost, but the rank has moved past it), or
      (c) the ranks still owing it went silent past the report bound and were
          declared gone.
    A copy whose report is merely late past the bound is marked overdue
    (counted and warned) and keeps its blocks: a slow asynchronous copy may
    still land, and its blocks must not belong to another entry when it does.
    Every path that frees a copy's blocks goes through `_settle_save`,
    `_complete_load` or `_settle_load` below.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        counters: SchedulerCounters,
        bound: ReportBound,
        release_pin: Callable[[str], None],
    ) -> None:
        self.allocator = allocator
        self.counters = counters
        self.flights = Flights(bound)
        self.ranks = Ranks(bound)
        self._release_pin = release_pin
        self._warnings = RateLimitedWarnings(logger)

    @property
    def bound(self) -> ReportBound:
        return self.flights.bound

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Replace the time source of flights and ranks (tests)."""
        self.flights.clock = clock
        self.ranks.clock = clock

    # -------------------------------------------------------------- dispatch

    def start_step(self, meta: ECCPUConnectorMetadata, worker_step: int) -> None:
        """Every save and load of `meta` is in flight from now on."""
        self.flights.start_step(meta.saves, meta.loads, meta.step, worker_step)

    @property
    def awaiting_reports(self) -> bool:
        """True while a copy is in flight and not yet past the report bound."""
        return self.flights.num_awaited > 0

    # --------------------------------------------------------------- reports

    def apply(self, report: ECCPUWorkerReport) -> None:
        """Apply one (aggregated) report; unknown or repeated parts are counted and ignored."""
        for rank in self.ranks.heard(report.progress, report.group_size):
            logger.warning(
                "EC CPU tier: rank %d reports again after it was declared gone; copies "
                "handed to it meanwhile were not waited for",
                rank,
            )
        if report.save_acks:
            self._saves_reported(report.save_acks, True)
        if report.failed_saves:
            self._saves_reported(report.failed_saves, False)
        if report.load_acks:
            self._loads_reported(report.load_acks)
        for rank, kind in report.fallbacks:
            per_rank = (
                self.counters.save_fallbacks_by_rank
                if kind == "save"
                else self.counters.load_fallbacks_by_rank
            )
            per_rank[rank] = per_rank.get(rank, 0) + 1
        self._retire_silent_ranks()
        self._settle_through_floor()

    def _saves_reported(self, reports: list[tuple[int, int, str]], ok: bool) -> None:
        """Settle the save each `(rank, step, key)` names, landed (`ok`) or failed; a
        report of no save in flight (unknown, or of another step's save) is counted
        and ignored."""
        in_flight = self.flights.saves
        for rank, step, key in reports:
            copies = in_flight.get(key)
            if copies is None or copies.step != step:
                self.counters.reports_ignored += 1
            else:
                self._settle_save(key, ok, rank)

    def _loads_reported(self, acks: list[tuple[int, int]]) -> None:
        """Record each `(rank, tid)` load report; a load every rank that may still run
        it has reported is complete."""
        in_flight = self.flights.loads
        counters = self.counters
        by_rank = counters.loads_by_rank
        ranks = self.ranks
        for rank, tid in acks:
            flight = in_flight.get(tid)
            if flight is None or rank in flight.acked:
                counters.reports_ignored += 1
                continue
            acked = flight.acked
            acked.add(rank)
            by_rank[rank] = by_rank.get(rank, 0) + 1
            if ranks.all_acked(acked):
                self._complete_load(flight)

    # -------------------------------------------------------------- settling

    def _settle_save(self, key: str, ok: bool | None, rank: int | None = None) -> None:
        """Settle the save of `key` in flight. `ok`: landed (True), failed (False), or
        settled without a report (None)."""
        self.flights.finish_save(key)
        allocator = self.allocator
        entry = allocator.get(key)
        if entry is None or entry.ready:  # gone since (shutdown); nothing to do
            self.counters.reports_ignored += 1
            return
        if ok:
            allocator.mark_entry_ready(entry)
            counters = self.counters
            counters.saves_completed += 1
            if rank is not None:
                saves = counters.saves_by_rank
                saves[rank] = saves.get(rank, 0) + 1
            return
        allocator.discard(key)
        if ok is None:
            self.counters.reports_lost += 1
        else:
            self.counters.saves_failed += 1

    def _complete_load(self, flight: LoadFlight) -> None:
        # Finish the record before releasing the pin: a replayed report then
        # finds nothing and cannot release a later load's pin.
        self.flights.finish_load(flight)
        self._release_pin(flight.key)
        self.counters.loads_completed += 1

    def _settle_load(self, flight: LoadFlight) -> None:
        """Every live rank has moved past the load: it landed there (a failed load
        stops the engine), though some reports were lost."""
        if not self.ranks.live <= flight.acked:
            self.counters.reports_lost += 1
        self._complete_load(flight)

    def _settle_through_floor(self) -> None:
        floor = self.ranks.floor()
        if floor is None:
            return
        flights = self.flights
        for copies in flights.through(floor):
            for key in flights.unsettled_saves(copies):
                self._settle_save(key, None)
            for load in flights.unsettled_loads(copies):
                self._settle_load(load)

    # ------------------------------------------------------------ each step

    def on_worker_step(self, worker_step: int) -> None:
        """Mark the copies whose reports are past the bound overdue."""
        flights = self.flights
        for copies in flights.overdue(worker_step):
            for key in flights.unsettled_saves(copies):
                self.counters.saves_reclaimed += 1
                self._warn_overdue(f"the save of {key}")
            for load in flights.unsettled_loads(copies):
                self.counters.loads_reclaimed += 1
                self._warn_overdue(
                    f"load {load.tid} of {load.key} ({len(load.acked)} ranks reported)"
                )

    def _retire_silent_ranks(self) -> None:
        missing = self.ranks.missing()
        if missing:
            logger.warning(
                "EC CPU tier: %d of the %d ranks the workers announced never reported; "
                "their copies are no longer waited for",
                missing,
                self.ranks.expected,
            )
        gone = self.ranks.silent()
        if gone:
            logger.warning(
                "EC CPU tier: rank(s) %s missed more than %d reports in a row (and %.1f s); "
                "they are treated as gone and their copies are no longer waited for",
                sorted(gone),
                self.bound.steps,
                self.bound.seconds,
            )
        if not (missing or gone):
            return
        # Loads the remaining ranks all reported were waiting only for these.
        acked = self.ranks.all_acked
        for load in [f for f in self.flights.loads.values() if acked(f.acked)]:
            self._complete_load(load)

    def _warn_overdue(self, what: str) -> None:
        self._warnings.warn(
            "overdue",
            "EC CPU tier: %s is unreported after %d worker steps and %.1f s; its blocks "
            "stay held until every rank has moved past it",
            what,
            self.bound.steps,
            self.bound.seconds,
        )

    def clear(self) -> None:
        self.flights.clear()
