"""Settlement with several ranks whose reports arrive one rank at a time."""

from __future__ import annotations

from collections.abc import Callable

from ec_scheduler import ECCPUScheduler
from ectools.driving import Item, SimulatedRanks, StepDriver, connector_output, make_request

SchedulerFactory = Callable[..., ECCPUScheduler]


def test_a_load_waits_for_an_announced_rank_not_heard_from_yet(
    make_scheduler: SchedulerFactory,
) -> None:
    """Two ranks announced, only rank 0 heard so far: its word alone must not release
    a load that rank 1 may still be reading (the floor waits for it the same way)."""
    scheduler = make_scheduler(ec_report_timeout_steps=2, ec_report_timeout_s=0)
    sim = SimulatedRanks(2)
    driver = StepDriver(scheduler)
    save = driver.step([make_request("w", [Item("a")])]).meta
    # Rank 0's report of the save arrives; rank 1's reports are still on their way.
    scheduler.update_connector_output(connector_output(sim.report(save, ranks=[0])))
    entry = scheduler.allocator.get("a")
    assert entry is not None and entry.ready
    load = driver.step([make_request("r", [Item("a")])]).meta
    assert load.loads
    scheduler.update_connector_output(connector_output(sim.report(load, ranks=[0])))
    assert entry.pins == 1, "rank 1, announced but not heard from, may still read the blocks"
    assert scheduler.counters.loads_completed == 0
    # Rank 1's reports arrive: now every rank has finished it.
    scheduler.update_connector_output(connector_output(sim.report(save, ranks=[1])))
    assert entry.pins == 1
    scheduler.update_connector_output(connector_output(sim.report(load, ranks=[1])))
    assert entry.pins == 0 and entry.evictable
    assert scheduler.counters.loads_completed == 1
    assert scheduler.counters.reports_lost == 0
    assert not scheduler.flights


def test_a_load_of_an_announced_rank_that_never_reports_is_released_once_given_up(
    make_scheduler: SchedulerFactory,
) -> None:
    """Rank 1 never reports at all: once the bound passes it is given up on and the
    load rank 0 finished no longer holds its pin."""
    scheduler = make_scheduler(ec_report_timeout_steps=2, ec_report_timeout_s=0)
    sim = SimulatedRanks(2)
    driver = StepDriver(scheduler)
    save = driver.step([make_request("w", [Item("a")])]).meta
    scheduler.update_connector_output(connector_output(sim.report(save, ranks=[0])))
    load = driver.step([make_request("r", [Item("a")])]).meta
    scheduler.update_connector_output(connector_output(sim.report(load, ranks=[0])))
    entry = scheduler.allocator.get("a")
    assert entry is not None
    for _ in range(3):
        step = driver.step([]).meta
        scheduler.update_connector_output(connector_output(sim.report(step, ranks=[0])))
    assert scheduler.settlement.ranks.missing_given_up
    assert entry.pins == 0 and entry.evictable
    assert scheduler.counters.loads_completed == 1
    assert not scheduler.flights


def test_a_load_reported_by_the_remaining_ranks_settles_when_the_missing_one_is_given_up(
    make_scheduler: SchedulerFactory,
) -> None:
    """Rank 0 reported the load but has not settled past it (an earlier copy still
    runs there): giving up on the never-heard rank 1 releases the load at once."""
    scheduler = make_scheduler(ec_report_timeout_steps=2, ec_report_timeout_s=0)
    sim = SimulatedRanks(2)
    driver = StepDriver(scheduler)
    save = driver.step([make_request("w", [Item("a")])]).meta
    scheduler.update_connector_output(connector_output(sim.report(save, ranks=[0])))
    slow = driver.step([make_request("s", [Item("b")])]).meta  # rank 0's save of b lingers
    load = driver.step([make_request("r", [Item("a")])]).meta
    entry = scheduler.allocator.get("a")
    assert entry is not None and entry.pins == 1
    for _ in range(3):
        step = driver.step([]).meta
        report = sim.report(load if step.step == load.step + 1 else step, ranks=[0])
        report.progress[-1] = (0, step.step, slow.step - 1)
        scheduler.update_connector_output(connector_output(report))
    assert scheduler.settlement.ranks.missing_given_up
    assert entry.pins == 0, "only rank 0 is left, and it reported the load"
    assert scheduler.counters.loads_completed == 1
