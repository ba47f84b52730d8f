"""Copies handed to the workers that have not settled yet, and the ranks that do them.

A save is in flight from the step its metadata leaves the scheduler until
the saving rank reports it; a load until every live rank has. Every worker
also reports, each step, the step up to which all its copies have *settled*
(landed, or failed and said so), so a copy whose own report was lost still
settles once each live rank has moved past it.

Records are kept per step, in dispatch order: a save in flight costs one
dictionary entry, a load one small record, and settling or finding overdue
copies costs O(steps settled + copies settled or overdue), never O(in flight).
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
class StepCopies:
    """The copies of one metadata step: they started together, so their reports are
    past the bound together. `pending` counts the ones not settled yet."""

    step: int
    worker_step: int
    started: float
    saves: tuple[str, ...]
    tids: list[int]
    """The transfer ids of its loads (not the records: they point here, and a cycle
    would leave each step to the cyclic garbage collector)."""
    pending: int
    overdue: bool = False


@dataclass(eq=False, slots=True)
class LoadFlight:
    """The load of `key` under transfer id `tid`, one of `copies`; `acked` holds the
    ranks that reported it."""

    key: str
    tid: int
    copies: StepCopies
    acked: set[int] = field(default_factory=set)


class Flights:
    """The saves in flight (by key: the step's copies it is one of) and the loads in
    flight (by transfer id).

    Guarantees: `saves` and `loads` hold exactly the copies not settled yet (a
    caller settles a copy by `finish_save` or `finish_load`, once); `num_awaited`
    counts those of them not overdue; a step without copies leaves no record.
    The dispatch-order queues drop a step's record from their front only: one
    queue once the step is yielded by `through` or has settled, the other once
    it is yielded by `overdue` or has settled. So behind a step whose copies
    stay unsettled (a rank that has not reported yet, or one past the report
    bound that has not been given up on), the records of later steps wait, one
    per step with copies, until that step settles.
    """

    def __init__(self, bound: ReportBound, clock: Callable[[], float] = time.monotonic) -> None:
        self.bound = bound
        self.clock = clock
        self.saves: dict[str, StepCopies] = {}
        self.loads: dict[int, LoadFlight] = {}
        self._by_step: deque[StepCopies] = deque()
        """Steps with copies not settled, in dispatch order (steps never decrease)."""
        self._awaited: deque[StepCopies] = deque()
        """Steps not yet overdue, in dispatch order (for the report bound)."""
        self.num_awaited = 0
        """Copies neither settled nor overdue: the ones worth stepping for."""

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
        `saves` (an earlier save of that key still in flight is forgotten, as if
        it had settled: the allocator holds a save's entry until then, so the
        scheduler never saves its key again before), then a load per item of
        `loads` (key to `(tid, ...)`, as in the metadata)."""
        count = len(saves) + len(loads)
        if not count:
            return
        copies = StepCopies(step, worker_step, self.clock(), tuple(saves), [], count)
        if not self.saves.keys().isdisjoint(copies.saves):
            for key in self.saves.keys() & copies.saves:
                self.finish_save(key)
        self.saves.update(dict.fromkeys(copies.saves, copies))
        in_flight, tids = self.loads, copies.tids
        for key, (tid, _, _) in loads.items():
            in_flight[tid] = LoadFlight(key, tid, copies)
            tids.append(tid)
        self._by_step.append(copies)
        self._awaited.append(copies)
        self.num_awaited += count

    def finish_save(self, key: str) -> None:
        """Forget the save of `key`, which settled (it must be in `saves`)."""
        copies = self.saves.pop(key)
        copies.pending -= 1
        if not copies.overdue:
            self.num_awaited -= 1

    def finish_load(self, flight: LoadFlight) -> None:
        """Forget a load that settled (it must be in `loads`)."""
        del self.loads[flight.tid]
        copies = flight.copies
        copies.pending -= 1
        if not copies.overdue:
            self.num_awaited -= 1

    def unsettled_saves(self, copies: StepCopies) -> list[str]:
        """The keys of `copies`' saves still in flight."""
        in_flight = self.saves
        return [key for key in copies.saves if in_flight.get(key) is copies]

    def unsettled_loads(self, copies: StepCopies) -> list[LoadFlight]:
        """`copies`' loads still in flight (a transfer id is minted per dispatch, so the
        record under one of its ids is its own)."""
        in_flight = self.loads
        return [flight for tid in copies.tids if (flight := in_flight.get(tid)) is not None]

    def through(self, step: int) -> Iterator[StepCopies]:
        """Yield, oldest first, each step `<= step` with copies not settled (steps whose
        copies have all settled are dropped on the way).

        The caller settles every copy `unsettled_saves` and `unsettled_loads` name.
        """
        order = self._by_step
        while order and (not order[0].pending or order[0].step <= step):
            copies = order.popleft()
            if copies.pending:
                yield copies

    def overdue(self, worker_step: int) -> Iterator[StepCopies]:
        """Mark overdue and yield, oldest first, each step with copies not settled whose
        reports are past the bound."""
        order = self._awaited
        if not order:
            return
        now = self.clock()
        while order:
            copies = order[0]
            if copies.pending:
                if not self.bound.expired(copies.worker_step, copies.started, worker_step, now):
                    return
                copies.overdue = True
                self.num_awaited -= copies.pending
                order.popleft()
                yield copies
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
        if progress and group_size > self.expected:
            self.expected = group_size
        ranks_settled, ran = self.settled, self._ran
        for rank, step, settled in progress:
            before = ranks_settled.get(rank, settled)
            ranks_settled[rank] = before if before > settled else settled
            if self._first is None:
                self._first = (step, now)
            previous = ran.get(rank)
            if previous is None or step > previous[0]:
                ran[rank] = (step, now)
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
        return min(map(self.settled.__getitem__, self.live))

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
        newest, ran = self._newest, self._ran
        # The step half of the bound first: in the usual step every rank has just
        # reported, and the clock is not read.
        lagging = [rank for rank in self.live if newest - ran[rank][0] > self.bound.steps]
        if not lagging:
            return lagging
        now = self.clock()
        newly = [rank for rank in lagging if self.bound.expired(*ran[rank], newest, now)]
        for rank in newly:
            self.live.discard(rank)
            self.gone.add(rank)
        return newly
