"""Copies handed to the workers whose reports have not all arrived yet.

A save is in flight from the step its metadata leaves the scheduler until the
saving rank reports it; a load until every participating rank has. Records
are kept in dispatch order, so finding the ones whose report is overdue costs
O(overdue), never O(in flight).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass(slots=True)
class SaveFlight:
    """A save dispatched at worker step `step`, wall time `started`."""

    key: str
    step: int
    started: float
    serial: int


@dataclass(slots=True)
class LoadFlight:
    """A load of entry `key` under transfer id `tid`; `acked` holds reporting ranks."""

    key: str
    tid: int
    step: int
    started: float
    acked: set[int] = field(default_factory=set)
    anonymous_acks: int = 0

    def reports(self) -> int:
        return len(self.acked) + self.anonymous_acks


@dataclass(frozen=True, slots=True)
class ReportBound:
    """When a missing report counts as lost.

    A flight is lost once more than `steps` worker steps have passed since it
    was dispatched AND at least `seconds` have elapsed. `seconds = 0` leaves
    only the step bound; `steps = 0` means "lost at the next worker step".
    """

    steps: int
    seconds: float

    def expired(self, flight_step: int, flight_started: float, step: int, now: float) -> bool:
        return step - flight_step > self.steps and now - flight_started >= self.seconds


class Flights:
    """The in-flight saves (by key) and loads (by transfer id)."""

    def __init__(self, bound: ReportBound, clock: Callable[[], float] = time.monotonic) -> None:
        self.bound = bound
        self.clock = clock
        self.saves: dict[str, SaveFlight] = {}
        self.loads: dict[int, LoadFlight] = {}
        # Dispatch-ordered (kind, id, serial) records; a record whose flight has
        # already landed is skipped when it reaches the head.
        self._order: deque[tuple[str, str | int, int]] = deque()
        self._serial = 0

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)

    def start_save(self, key: str, step: int) -> None:
        self._serial += 1
        self.saves[key] = SaveFlight(key, step, self.clock(), self._serial)
        self._order.append(("save", key, self._serial))

    def start_load(self, key: str, tid: int, step: int) -> None:
        self._serial += 1
        self.loads[tid] = LoadFlight(key, tid, step, self.clock())
        self._order.append(("load", tid, self._serial))

    def expired(self, step: int) -> Iterator[SaveFlight | LoadFlight]:
        """Pop and yield, oldest first, every flight whose report is overdue."""
        now = self.clock()
        order = self._order
        while order:
            kind, ident, serial = order[0]
            flight: SaveFlight | LoadFlight | None
            if kind == "save":
                assert isinstance(ident, str)
                flight = self.saves.get(ident)
                if flight is not None and flight.serial != serial:
                    flight = None  # the key was saved again since; not this record
            else:
                assert isinstance(ident, int)
                flight = self.loads.get(ident)
            if flight is None:
                order.popleft()
                continue
            if not self.bound.expired(flight.step, flight.started, step, now):
                return
            order.popleft()
            if isinstance(flight, SaveFlight):
                del self.saves[flight.key]
            else:
                del self.loads[flight.tid]
            yield flight

    def clear(self) -> None:
        self.saves.clear()
        self.loads.clear()
        self._order.clear()
