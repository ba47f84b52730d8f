"""`StepPlan`: one step's copies, handed over once; nothing of a step leaks into the next."""

from __future__ import annotations

import copy
from collections.abc import Callable

from ec_scheduler import ECCPUScheduler
from ec_scheduler.step_plan import StepPlan
from ectools.driving import Item, SimulatedRanks, StepDriver, connector_output, make_request

SchedulerFactory = Callable[..., ECCPUScheduler]


def test_the_metadata_is_the_plan_in_planning_order() -> None:
    plan = StepPlan()
    plan.add_save("s1", [4, 5], (2, 8), ((4, 2),))
    plan.add_load("l1", 7, [0, 1], (2, 8), ((0, 2),))
    plan.takers["l1"] = ["r"]
    plan.add_save("s2", [9], (1, 8), ((9, 1),))
    meta = plan.hand_over(3)
    assert meta.step == 3
    assert meta.saves is plan.saves and meta.loads is plan.loads and meta.runs is plan.runs
    assert meta.save_shapes is plan.shapes
    assert list(meta.runs) == ["s1", "l1", "s2"], "saves and loads in the order they were planned"
    assert meta.loads == {"l1": (7, [0, 1], (2, 8))}
    assert meta.save_shapes == {"s1": (2, 8), "s2": (1, 8)}


def test_a_freed_load_is_withdrawn_unless_a_scheduled_request_takes_it() -> None:
    plan = StepPlan()
    for tid, key in enumerate(("kept", "gone", "other")):
        plan.add_load(key, tid, [tid], (1, 8), ((tid, 1),))
    plan.takers.update(kept=["a", "b"], gone=["c"], other=["d"])
    plan.add_save("saved", [9], (1, 8), ((9, 1),))
    withdrawn = plan.withdraw_untaken(["saved", "gone", "kept", "gone", "absent"], {"b": 1})
    assert withdrawn == [("gone", (1, 8))], "each withdrawn once; saves are never withdrawn"
    assert list(plan.loads) == ["kept", "other"] and list(plan.takers) == ["kept", "other"]
    assert list(plan.runs) == ["kept", "other", "saved"]


def test_a_handed_over_step_is_not_changed_by_the_next(make_scheduler: SchedulerFactory) -> None:
    """The workers may still read a step's metadata while the next step is planned."""
    scheduler = make_scheduler(blocks=64)
    driver = StepDriver(scheduler)
    ranks = SimulatedRanks()
    first = driver.step([make_request("r1", [Item("a"), Item("b")])]).meta
    kept = copy.deepcopy(first)
    scheduler.update_connector_output(connector_output(ranks.report(first)))
    second = driver.step([make_request("r2", [Item("a"), Item("c")])]).meta
    assert first == kept
    assert set(second.loads) == {"a"} and set(second.saves) == {"c"}
    assert second.saves is not first.saves and second.runs is not first.runs
    empty = driver.step([]).meta
    assert (empty.saves, empty.loads, empty.save_shapes, empty.runs) == ({}, {}, {}, {})
