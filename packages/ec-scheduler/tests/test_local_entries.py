"""`LocalEntries`: a remote source's reservations never reach this engine's own entries."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ec_core.scheduler_process.allocator import BlockAllocator
from ec_scheduler import ECCPUScheduler
from ec_scheduler.remote import LocalEntries
from ectools.driving import Item, StepDriver, make_request

SchedulerFactory = Callable[..., ECCPUScheduler]
WIDTH = 128


def _local_entries(scheduler: ECCPUScheduler) -> LocalEntries:
    """The `LocalEntries` the scheduler hands a remote source (built as it builds it)."""
    return LocalEntries(
        scheduler.allocator,
        scheduler.lock,
        scheduler._availability.release_pin,
        scheduler._availability.stale.__contains__,
        lambda rows, cols: scheduler.layout.blocks_for(rows, cols, 4),
    )


def _own_save_after_an_abandoned_fetch(
    make_scheduler: SchedulerFactory,
) -> tuple[ECCPUScheduler, LocalEntries, StepDriver, list[int]]:
    """A fetch of "a" failed and was abandoned; the request then encoded "a" here,
    and this engine's save of it is in flight (its blocks being written)."""
    scheduler = make_scheduler(blocks=16)
    local = _local_entries(scheduler)
    assert local.reserve("a", 8, WIDTH) is not None
    local.abandon("a")  # the READ failed: the reservation is over
    driver = StepDriver(scheduler)
    save = driver.step([make_request("r", [Item("a")])]).meta
    assert "a" in save.saves
    return scheduler, local, driver, save.saves["a"]


def test_abandoning_a_reservation_again_leaves_the_engines_own_save_alone(
    make_scheduler: SchedulerFactory,
) -> None:
    """The fetcher abandons a failed item twice (`_settle`, then `_free` once NIXL lets
    go of the READ, later when it was quarantined): by the second call the key is this
    engine's save in flight, whose blocks must not go to another entry meanwhile."""
    scheduler, local, driver, blocks = _own_save_after_an_abandoned_fetch(make_scheduler)
    entry = scheduler.allocator.get("a")
    local.abandon("a")  # the late second call
    assert scheduler.allocator.get("a") is entry, "the save in flight lost its blocks"
    other = driver.step([make_request("r2", [Item("b")])]).meta
    assert not set(other.saves["b"]) & set(blocks), "the worker still writes those blocks"


def test_landed_for_a_reservation_that_is_over_does_not_ready_the_engines_own_save(
    make_scheduler: SchedulerFactory,
) -> None:
    """`landed` for a key whose reservation went away answers False: it must not make
    this engine's save, not written yet, loadable."""
    scheduler, local, _, _ = _own_save_after_an_abandoned_fetch(make_scheduler)
    assert not local.landed("a")
    entry = scheduler.allocator.get("a")
    assert entry is not None and not entry.ready
    assert not scheduler.has_cache_item("a")


def test_a_reservation_lands_or_is_abandoned_once(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler(blocks=16)
    local = _local_entries(scheduler)
    assert local.reserve("a", 8, WIDTH) is not None
    assert local.reserve("b", 4, WIDTH) is not None
    assert local.landed_many(["a", "a"]) == [True, False]
    local.abandon_many(["a", "b", "b", "unknown"])
    entry = scheduler.allocator.get("a")
    assert entry is not None and entry.ready  # landed: abandoning it changes nothing
    assert "b" not in scheduler.allocator
    assert not local.landed("b")
    scheduler.allocator.check()


def test_the_states_of_several_entries_are_read_under_one_acquisition_of_the_lock() -> None:
    """`state_many` answers as `state` does for each key (a key asked twice is answered
    twice), with the reports that arrived off the engine loop applied once for all."""
    allocator = BlockAllocator(16)
    for key in ("ready", "stale"):
        assert allocator.alloc(key, 2) is not None
        allocator.mark_ready(key)
    assert allocator.alloc("saving", 2) is not None
    refreshes: list[None] = []
    local = LocalEntries(
        allocator,
        threading.RLock(),
        lambda key: None,
        {"stale"}.__contains__,
        lambda rows, cols: rows,
        refresh=lambda: refreshes.append(None),
    )
    keys = ["ready", "saving", "stale", "unknown", "ready"]
    expected = ["ready", "saving", "missing", "missing", "ready"]
    assert local.state_many(keys) == expected
    assert len(refreshes) == 1
    assert [local.state(key) for key in keys] == expected


def test_a_read_granted_to_a_peer_is_a_request_to_the_policy(
    make_scheduler: SchedulerFactory,
) -> None:
    """A peer's read of an entry is served from here: the policy counts it as a
    request (a lease's pin alone is no request), and a refused lease is not one."""
    scheduler = make_scheduler(blocks=16)
    local = _local_entries(scheduler)
    assert local.reserve("a", 8, WIDTH) is not None
    assert local.landed("a")
    sketch = scheduler.allocator.policy.sketch  # type: ignore[attr-defined]
    seen = sketch.estimate("a")
    assert [state for state, _, _ in local.lease_many([("a", 8, WIDTH), ("b", 8, WIDTH)])] == [
        "ready",
        "missing",
    ]
    assert sketch.estimate("a") == seen + 1 and sketch.estimate("b") == 0
    local.release(["a"])
    scheduler.allocator.check()
