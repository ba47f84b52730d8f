"""`Flights`: the copies in flight, recorded per step, and their accounting."""

from __future__ import annotations

import gc

from ec_scheduler.flights import Flights, ReportBound


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def loads_of(*pairs: tuple[str, int]) -> dict[str, tuple[int, object, object]]:
    """Metadata-shaped loads: key -> (tid, block ids, shape)."""
    return {key: (tid, [], (1, 1)) for key, tid in pairs}


def test_each_copy_counts_until_it_settles_and_a_settled_step_is_dropped() -> None:
    flights = Flights(ReportBound(steps=2, seconds=0))
    flights.start_step(["a", "b"], loads_of(("c", 7)), step=1, worker_step=1)
    flights.start_step([], {}, step=2, worker_step=2)  # nothing to copy: no record
    flights.start_step(["d"], {}, step=3, worker_step=3)
    assert flights.num_awaited == 4 and set(flights.saves) == {"a", "b", "d"}
    flights.finish_save("a")
    flights.finish_load(flights.loads[7])
    assert flights.num_awaited == 2 and flights
    # Step 1 still has "b": through(1) yields it, naming only what is in flight.
    (step1,) = list(flights.through(1))
    assert step1.step == 1
    assert flights.unsettled_saves(step1) == ["b"] and flights.unsettled_loads(step1) == []
    flights.finish_save("b")
    flights.finish_save("d")
    assert flights.num_awaited == 0 and not flights
    # Step 3's copies all settled: it is dropped without being yielded, whatever the step.
    assert list(flights.through(0)) == []
    assert not flights._by_step


def test_a_step_past_the_bound_is_overdue_once_and_its_copies_no_longer_awaited() -> None:
    clock = Clock()
    flights = Flights(ReportBound(steps=1, seconds=5), clock)
    flights.start_step(["a"], loads_of(("b", 1), ("c", 2)), step=1, worker_step=1)
    flights.finish_load(flights.loads[2])
    assert list(flights.overdue(3)) == [], "two steps on, but not five seconds"
    clock.now = 5.0
    assert list(flights.overdue(2)) == [], "five seconds, but one step"
    (late,) = list(flights.overdue(3))
    assert late.overdue
    assert flights.unsettled_saves(late) == ["a"]
    assert [load.tid for load in flights.unsettled_loads(late)] == [1]
    assert flights.num_awaited == 0 and flights, "overdue copies stay in flight"
    assert list(flights.overdue(9)) == [], "a step is overdue once"
    flights.finish_save("a")
    flights.finish_load(flights.loads[1])
    assert flights.num_awaited == 0 and not flights


def test_a_save_dispatched_again_while_in_flight_replaces_the_earlier_one() -> None:
    """The scheduler never does this (the allocator holds the key until the save
    settles); if it did, the earlier save is forgotten and nothing is counted twice."""
    flights = Flights(ReportBound(steps=2, seconds=0))
    flights.start_step(["a", "b"], {}, step=1, worker_step=1)
    flights.start_step(["a"], {}, step=2, worker_step=2)
    assert flights.num_awaited == 2 and flights.saves["a"].step == 2
    (step1,) = list(flights.through(1))
    assert flights.unsettled_saves(step1) == ["b"]
    flights.finish_save("b")
    flights.finish_save("a")
    assert flights.num_awaited == 0 and not flights
    assert list(flights.through(5)) == [] and not flights._by_step


def test_settled_steps_leave_no_cyclic_garbage() -> None:
    """A step's records are freed by reference counting once its copies settle: none
    waits for the cyclic garbage collector (a load's record points to its step, and
    the step names its loads by transfer id only)."""
    flights = Flights(ReportBound(steps=2, seconds=0))
    gc.collect()
    gc.disable()
    try:
        for step in range(1, 201):
            flights.start_step([f"s{step}"], loads_of((f"l{step}", step)), step, step)
            flights.finish_save(f"s{step}")
            flights.finish_load(flights.loads[step])
            assert list(flights.through(step)) == []
            assert list(flights.overdue(step)) == []
        assert gc.collect() == 0
    finally:
        gc.enable()
