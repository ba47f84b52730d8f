"""Copies handed to the workers that have not settled yet, and the ranks that do them.

A save is in flight from the step its metadata leaves the scheduler until
the saving rank reports it; a load until every live rank has. Every worker
also reports, each step, the step up to which all its copies have *settled*
(landed, or failed and said so), so a copy whose own report was lost still
settles once each live rank has moved past it.

Records are kept in dispatch order, so settling and finding overdue copies
cost O(settled + overdue), never O(in flight).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ReportBound:
    """When a missing report stops being waited for.

    A copy, or a rank's silence, is past the bound once more than `steps`
    worker steps have passed AND at least `seconds` have elapsed. `seconds =
    0` leaves only the step bound; `steps = 0` means "at the next worker step".
    """

    steps: int
    seconds: float

    def expired(self, since_step: int, since: float, step: int, now: float) -> bool:
        return step - since_step > self.steps and now - since >= self.seconds


@dataclass(eq=False, slots=True)
class SaveFlight:
    """The save of `key` asked for in metadata step `step`."""

    key: str
    step: int
    worker_step: int
    started: float
    overdue: bool = False
    done: bool = False


@dataclass(eq=False, slots=True)
class LoadFlight:
    """The load of `key` under transfer id `tid`; `acked` holds the ranks that reported it."""

    key: str
    tid: int
    step: int
    worker_step: int
    started: float
    acked: set[int] = field(default_factory=set)
    overdue: bool = False
    done: bool = False


Flight = SaveFlight | LoadFlight


class Flights:
    """The saves in flight (one per key) and loads in flight (by transfer id)."""

    def __init__(self, bound: ReportBound, clock: Callable[[], float] = time.monotonic) -> None:
        self.bound = bound
        self.clock = clock
        self.saves: dict[str, SaveFlight] = {}
        self.loads: dict[int, LoadFlight] = {}
        self._by_step: deque[Flight] = deque()
        """Every flight not yet settled, in dispatch order (steps never decrease)."""
        self._awaited: deque[Flight] = deque()
        """Flights not yet overdue, in dispatch order (for the report bound)."""
        self.num_awaited = 0
        """Flights neither settled nor overdue: the ones worth stepping for."""

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)

    def start_step(
        self,
        saves: Collection[str],
        loads: Mapping[str, tuple[int, object, object]],
        step: int,
        worker_step: int,
    ) -> None:
        """Put one step's copies in flight, all started now: a save per key of
        `saves` (replacing an earlier record of that key), then a load per item
        of `loads` (key to `(tid, ...)`, as in the metadata)."""
        now = self.clock()
        by_step, awaited = self._by_step, self._awaited
        flight: Flight
        for key in saves:
            flight = SaveFlight(key, step, worker_step, now)
            self.saves[key] = flight
            by_step.append(flight)
            awaited.append(flight)
        for key, (tid, _, _) in loads.items():
            flight = LoadFlight(key, tid, step, worker_step, now)
            self.loads[tid] = flight
            by_step.append(flight)
            awaited.append(flight)
        self.num_awaited += len(saves) + len(loads)

    def finish(self, flight: Flight) -> None:
        """Forget a flight that settled (its deque records are dropped lazily)."""
        if flight.done:
            return
        flight.done = True
        if not flight.overdue:
            self.num_awaited -= 1
        if isinstance(flight, SaveFlight):
            del self.saves[flight.key]
        else:
            del self.loads[flight.tid]

    def through(self, step: int) -> Iterator[Flight]:
        """Yield, oldest first, each unfinished flight asked for in a step `<= step`.

        The caller settles (and `finish`es) every flight it is given.
        """
        order = self._by_step
        while order and (order[0].done or order[0].step <= step):
            flight = order.popleft()
            if not flight.done:
                yield flight

    def overdue(self, worker_step: int) -> Iterator[Flight]:
        """Mark and yield, oldest first, each flight whose report is past the bound."""
        now = self.clock()
        order = self._awaited
        while order:
            flight = order[0]
            if not flight.done:
                if not self.bound.expired(flight.worker_step, flight.started, worker_step, now):
                    return
                flight.overdue = True
                self.num_awaited -= 1
                order.popleft()
                yield flight
            else:
                order.popleft()

    def clear(self) -> None:
        self.saves.clear()
        self.loads.clear()
        self._by_step.clear()
        self._awaited.clear()
        self.num_awaited = 0


class Ranks:
    """The worker ranks heard from, how far each has settled, and which went silent.

    A rank is *live* from its first report until the other ranks have run
    more than `bound.steps` metadata steps beyond the last one it reported,
    for at least `bound.seconds`; it is live again if it reports again. A
    rank the workers announced (`group_size`) that has not reported by then
    is given up on the same way. Silence is measured in steps the other ranks
    say they ran, so an idle engine, steps that never reach the workers, or
    a report delivered twice make no rank silent. In vLLM every rank reports
    in every step that reaches the workers, and an executor whose worker
    stops answering stops the engine, so a rank goes silent like this only
    if it is dead.
    """

    def __init__(self, bound: ReportBound, clock: Callable[[], float] = time.monotonic) -> None:
        self.bound = bound
        self.clock = clock
        self.settled: dict[int, int] = {}
        """Each rank heard from: the step up to which its copies have settled."""
        self.live: set[int] = set()
        self.gone: set[int] = set()
        self.expected = 1
        """How many ranks the workers say there are (`group_size`)."""
        self.missing_given_up = False
        """Set once announced ranks that never reported are no longer waited for."""
        self._newest = 0
        self._first: tuple[int, float] | None = None
        self._ran: dict[int, tuple[int, float]] = {}
        """Each rank: the last step it ran, and when it was first reported."""

    def heard(self, progress: list[tuple[int, int, int]], group_size: int = 1) -> list[int]:
        """Record one report's `(rank, step, settled)` entries; return ranks that were gone."""
        now = self.clock()
        back = []
        for rank, step, settled in progress:
            self.expected = max(self.expected, group_size)
            self.settled[rank] = max(self.settled.get(rank, settled), settled)
            if self._first is None:
                self._first = (step, now)
            previous = self._ran.get(rank)
            if previous is None or step > previous[0]:
                self._ran[rank] = (step, now)
            self._newest = max(self._newest, step)
            self.live.add(rank)
            if rank in self.gone:
                self.gone.discard(rank)
                back.append(rank)
        return back

    def all_heard(self) -> bool:
        """Whether every rank the workers announced has reported once, or the ones
        that never did were given up on (see `missing`)."""
        return len(self.settled) >= self.expected or self.missing_given_up

    def all_acked(self, acked: set[int]) -> bool:
        """Whether `acked` covers every rank that may still run a copy: every live
        rank, once all announced ranks were heard from (see `all_heard`)."""
        return self.live <= acked and self.all_heard()

    def floor(self) -> int | None:
        """The last step every live rank has settled.

        None until every rank the workers announced has reported once (or the
        missing ones were given up, see `missing`): a rank not heard from yet
        may be running any copy, so nothing can be settled on the others' word.
        """
        if not self.live or not self.all_heard():
            return None
        return min(self.settled[rank] for rank in self.live)

    def missing(self) -> int:
        """How many announced ranks never reported, once that has lasted past the bound.

        They are then given up on, like silent ranks (0 when none, or not yet).
        """
        count = self.expected - len(self.settled)
        if count <= 0 or self.missing_given_up or self._first is None:
            return 0
        if not self.bound.expired(*self._first, self._newest, self.clock()):
            return 0
        self.missing_given_up = True
        return count

    def silent(self) -> list[int]:
        """Declare gone, and return, the live ranks silent past the bound."""
        now = self.clock()
        newly = [
            rank for rank in self.live if self.bound.expired(*self._ran[rank], self._newest, now)
        ]
        for rank in newly:
            self.live.discard(rank)
            self.gone.add(rank)
        return newly
