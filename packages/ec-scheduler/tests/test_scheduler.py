"""ECCPUScheduler driven with real vLLM requests, outputs and configs."""

from __future__ import annotations

import copy
import gc
import logging
import sys
import threading
from collections.abc import Callable

import pytest
from vllm.config import VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata

from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerMetadata, ECCPUWorkerReport
from ec_core.scheduler_process.policy_wtinylfu import WTinyLFUPolicy
from ec_scheduler import ECCPUScheduler
from ec_scheduler.remote import LocalEntries
from ectools.driving import (
    Item,
    SimulatedRanks,
    StepDriver,
    connector_output,
    make_request,
    scheduler_output,
)

H = "a" * 64
WIDTH = 128  # the tiny BLIP-2's embedding width (see conftest)
SchedulerFactory = Callable[..., ECCPUScheduler]


def _has(scheduler: ECCPUScheduler, key: str, embeds: int = 8) -> bool:
    """`has_cache_item(key)` as vLLM asks it: right after `ensure_cache_available` for
    a request with that item (the tier resolves the identifier through it)."""
    scheduler.ensure_cache_available(make_request(f"ask-{key}", [Item(key, embeds)]), 0)
    return scheduler.has_cache_item(key)


def _save_and_report(scheduler: ECCPUScheduler, *items: Item, ranks: int = 1) -> None:
    result = StepDriver(scheduler).step([make_request("warm", items)])
    scheduler.update_connector_output(connector_output(SimulatedRanks(ranks).report(result.meta)))


def test_offload_then_reuse_cycle(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler()
    driver = StepDriver(scheduler)
    first = driver.step([make_request("r1", [Item(H)])])
    assert first.looked_up == {H: False}
    assert list(first.meta.saves) == [H]
    assert first.meta.loads == {}
    saved_blocks = first.meta.saves[H]
    assert saved_blocks == list(range(8))  # 8 rows x 128 fp32 = 8 blocks, one run
    assert first.meta.runs == {H: ((0, 8),)}, "the descriptors travel with the ids"
    assert not _has(scheduler, H), "not ready until the save is reported"
    scheduler.build_connector_meta(scheduler_output())  # release that lookup's nothing
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(first.meta)))

    second = driver.step([make_request("r2", [Item(H)])])
    assert second.looked_up == {H: True}
    assert second.meta.saves == {}
    tid, blocks, shape = second.meta.loads[H]
    assert blocks == saved_blocks
    assert second.meta.runs == {H: ((0, 8),)}
    assert shape == (8, WIDTH)
    assert isinstance(tid, int)
    assert scheduler.counters.hits == 1
    assert scheduler.counters.saves_completed == 1


def test_build_connector_meta_resets_per_step_state(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler()
    meta = StepDriver(scheduler).step([make_request("r", [Item(H)])]).meta
    assert isinstance(meta, ECCPUConnectorMetadata)
    again = scheduler.build_connector_meta(scheduler_output())
    assert again.saves == {} and again.loads == {} and again.runs == {}
    assert again is not meta


def test_keyed_on_identifier_not_mm_hash(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler()
    lora_key = f"lora-7:{H}"
    _save_and_report(scheduler, Item(lora_key))
    assert _has(scheduler, lora_key)
    assert not _has(scheduler, H)


def test_multiple_items_per_request_and_repeats_in_one_step(
    make_scheduler: SchedulerFactory,
) -> None:
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item("x"), Item("y"))
    result = StepDriver(scheduler).step(
        [make_request("r1", [Item("x"), Item("y")]), make_request("r2", [Item("x")])]
    )
    assert set(result.meta.loads) == {"x", "y"}
    tids = [tid for tid, _, _ in result.meta.loads.values()]
    assert len(set(tids)) == 2
    # Looking the same item up again in the same step does not pin it twice.
    assert scheduler.allocator.get("x").pins == 1  # type: ignore[union-attr]


def test_each_dispatch_mints_a_new_transfer_id(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item(H))
    driver = StepDriver(scheduler)
    first = driver.step([make_request("a", [Item(H)])]).meta
    second = driver.step([make_request("b", [Item(H)])]).meta
    tid1, tid2 = first.loads[H][0], second.loads[H][0]
    assert tid1 != tid2
    assert scheduler.allocator.get(H).pins == 2  # type: ignore[union-attr]
    # A late or replayed report of the first load releases only the first pin.
    ranks = SimulatedRanks()
    scheduler.update_connector_output(connector_output(ranks.report(first)))
    scheduler.update_connector_output(connector_output(ranks.report(first)))
    assert scheduler.allocator.get(H).pins == 1  # type: ignore[union-attr]
    assert scheduler.counters.reports_ignored == 1
    scheduler.update_connector_output(connector_output(ranks.report(second)))
    assert scheduler.allocator.get(H).pins == 0  # type: ignore[union-attr]


def test_roles(make_scheduler: SchedulerFactory, ec_log: pytest.LogCaptureFixture) -> None:
    make_scheduler(role="ec_both")
    assert not any("without ec_peer_listen" in r.getMessage() for r in ec_log.records)
    producer = make_scheduler(role="ec_producer")
    # vLLM's V1 runner drops an encode-only engine's reports: said at start.
    assert any("without ec_peer_listen" in r.getMessage() for r in ec_log.records)
    _save_and_report(producer, Item(H))
    assert not _has(producer, H), "a producer never loads"
    result = StepDriver(producer).step([make_request("r", [Item(H)])])
    assert result.meta.loads == {} and result.meta.saves == {}

    consumer = make_scheduler(role="ec_consumer")
    assert any("ec_consumer" in r.getMessage() for r in ec_log.records)
    result = StepDriver(consumer).step([make_request("r", [Item(H)])])
    assert result.meta.saves == {}, "a consumer never saves"
    assert not _has(consumer, H)
    assert consumer.ensure_cache_available(make_request("r", [Item(H)]), 0)


def test_tp_reports_are_counted_per_rank(make_scheduler: SchedulerFactory) -> None:
    for ranks in (1, 2, 4):
        scheduler = make_scheduler()
        sim = SimulatedRanks(ranks)
        _save_and_report(scheduler, Item(H), ranks=ranks)
        meta = StepDriver(scheduler).step([make_request("r", [Item(H)])]).meta
        entry = scheduler.allocator.get(H)
        assert entry is not None
        for rank in range(ranks):
            assert entry.pins == 1, f"released after {rank} of {ranks} ranks"
            # The other ranks report too, still busy with this step.
            others = [r for r in range(ranks) if r > rank]
            report = sim.report(meta, ranks=[rank], settled=meta.step - 1, waiting=others)
            scheduler.update_connector_output(connector_output(report))
            # The same rank reporting again is not another rank.
            again = sim.report(meta, ranks=[rank], settled=meta.step - 1, waiting=others)
            scheduler.update_connector_output(connector_output(again))
        assert entry.pins == 0
        assert scheduler.counters.loads_completed == 1
        assert scheduler.counters.loads_by_rank == dict.fromkeys(range(ranks), 1)
        assert scheduler.counters.saves_by_rank == {0: 1}


def test_reports_out_of_order_and_interleaved(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler()
    sim = SimulatedRanks(2)
    _save_and_report(scheduler, Item("a"), Item("b"), ranks=2)
    driver = StepDriver(scheduler)
    m1 = driver.step([make_request("1", [Item("a")])]).meta
    m2 = driver.step([make_request("2", [Item("b")])]).meta
    # Rank 1 finished m2 before m1: it has not settled past m1 yet.
    early = sim.report(m2, ranks=[1], settled=m1.step - 1)
    scheduler.update_connector_output(connector_output(early))
    scheduler.update_connector_output(connector_output(sim.report(m1, ranks=[0], settled=m1.step)))
    scheduler.update_connector_output(connector_output(sim.report(m2, ranks=[0])))
    assert scheduler.allocator.get("b").pins == 0  # type: ignore[union-attr]
    assert scheduler.allocator.get("a").pins == 1  # type: ignore[union-attr]
    scheduler.update_connector_output(connector_output(sim.report(m1, ranks=[1])))
    assert scheduler.allocator.get("a").pins == 0  # type: ignore[union-attr]
    assert scheduler.counters.reports_lost == 0


def test_a_lost_report_settles_once_every_rank_has_moved_past_it(
    make_scheduler: SchedulerFactory,
) -> None:
    """No timeout needed: a later report saying the rank settled past the copy suffices."""
    scheduler = make_scheduler()
    sim = SimulatedRanks(2)
    _save_and_report(scheduler, Item("a"), ranks=2)
    driver = StepDriver(scheduler)
    load = driver.step([make_request("1", [Item("a")])]).meta
    save = driver.step([make_request("2", [Item("b")])]).meta
    scheduler.update_connector_output(
        connector_output(sim.report(load, ranks=[0], settled=load.step))
    )
    later = scheduler.build_connector_meta(scheduler_output())
    # Rank 1's report of the load and rank 0's of the save are lost; both ranks move on.
    scheduler.update_connector_output(connector_output(sim.report(later, ranks=[1])))
    entry = scheduler.allocator.get("a")
    assert entry is not None and entry.pins == 0, "rank 0 reported it, rank 1 moved past it"
    saving = scheduler.allocator.get("b")
    assert saving is not None and not saving.ready, "rank 0 has not moved past the save yet"
    scheduler.update_connector_output(connector_output(sim.report(later, ranks=[0])))
    assert "b" not in scheduler.allocator, "a save without its report is discarded, never ready"
    assert scheduler.counters.reports_lost == 2
    assert scheduler.counters.loads_completed == 1
    assert not scheduler.flights and not scheduler.allocator.has_held_entries()
    # The lost reports arriving after all are ignored.
    ignored = scheduler.counters.reports_ignored
    scheduler.update_connector_output(connector_output(sim.report(save, ranks=[0])))
    scheduler.update_connector_output(connector_output(sim.report(load, ranks=[1])))
    assert "b" not in scheduler.allocator
    assert scheduler.counters.reports_ignored == ignored + 2


def test_a_plain_worker_metadata_is_ignored_and_counted(
    make_scheduler: SchedulerFactory, ec_log: pytest.LogCaptureFixture
) -> None:
    """Only ECCPUWorkerReport carries ranks and steps; a bare report cannot be applied safely."""
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item(H))
    meta = StepDriver(scheduler).step([make_request("r", [Item(H)])]).meta
    tid = meta.loads[H][0]
    for _ in range(2):
        scheduler.update_connector_output(connector_output(ECCPUWorkerMetadata([], [tid])))
    assert scheduler.allocator.get(H).pins == 1  # type: ignore[union-attr]
    assert scheduler.counters.reports_ignored == 2
    assert len([r for r in ec_log.records if "ignoring a worker report" in r.getMessage()]) == 1


def test_async_scheduling_next_step_before_previous_output(
    make_scheduler: SchedulerFactory,
) -> None:
    scheduler = make_scheduler()
    sim = SimulatedRanks()
    driver = StepDriver(scheduler)
    step1 = driver.step([make_request("1", [Item("a")])]).meta
    # Step 2 is scheduled before step 1's output: "a" is not ready, so no load,
    # and it is not saved twice.
    step2 = driver.step([make_request("2", [Item("a"), Item("b")])]).meta
    assert step2.loads == {} and list(step2.saves) == ["b"]
    scheduler.update_connector_output(connector_output(sim.report(step1)))
    step3 = driver.step([make_request("3", [Item("a")])]).meta
    scheduler.update_connector_output(connector_output(sim.report(step2)))
    assert "a" in step3.loads
    scheduler.update_connector_output(connector_output(sim.report(step3)))
    assert not scheduler.allocator.has_held_entries()


def test_update_connector_output_ignores_foreign_and_unknown(
    make_scheduler: SchedulerFactory,
) -> None:
    class Foreign(ECConnectorWorkerMetadata):
        def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
            return self

    scheduler = make_scheduler()
    scheduler.update_connector_output(connector_output(None))
    scheduler.update_connector_output(connector_output(Foreign()))
    unknown = ECCPUWorkerReport(
        progress=[(0, 0, 0)], save_acks=[(0, 1, "nope")], load_acks=[(0, 99)]
    )
    scheduler.update_connector_output(connector_output(unknown))
    assert scheduler.counters.reports_ignored == 3
    assert len(scheduler.allocator) == 0


def test_a_save_report_of_another_step_is_not_taken_for_this_one(
    make_scheduler: SchedulerFactory,
) -> None:
    scheduler = make_scheduler()
    meta = StepDriver(scheduler).step([make_request("r", [Item(H)])]).meta
    stale = ECCPUWorkerReport(
        progress=[(0, meta.step - 1, meta.step - 1)], save_acks=[(0, meta.step - 1, H)]
    )
    scheduler.update_connector_output(connector_output(stale))
    assert not scheduler.allocator.get(H).ready  # type: ignore[union-attr]
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(meta)))
    assert scheduler.allocator.get(H).ready  # type: ignore[union-attr]


def test_failed_save_drops_the_entry(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler()
    meta = StepDriver(scheduler).step([make_request("r", [Item(H)])]).meta
    scheduler.update_connector_output(
        connector_output(SimulatedRanks().report(meta, fail_saves=[H]))
    )
    assert H not in scheduler.allocator
    assert scheduler.counters.saves_failed == 1
    assert not scheduler.allocator.has_held_entries()


def test_fallbacks_are_counted_per_rank_and_the_load_still_completes(
    make_scheduler: SchedulerFactory,
) -> None:
    """Rank 1 copied synchronously: the load is complete, and the counters say who fell back."""
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item(H), ranks=2)
    scheduler.get_ec_connector_stats()
    meta = StepDriver(scheduler).step([make_request("r", [Item(H)])]).meta
    report = SimulatedRanks(2).report(meta)
    report.fallbacks.append((1, "load"))
    scheduler.update_connector_output(connector_output(report))
    counters = scheduler.counters
    assert counters.loads_completed == 1 and counters.load_fallbacks == 1
    assert counters.load_fallbacks_by_rank == {1: 1} and counters.save_fallbacks_by_rank == {}
    stats = scheduler.get_ec_connector_stats()
    assert stats is not None
    assert stats.data["load_fallbacks"] == 1 and stats.data["loads"] == 1
    assert stats.data["rank_copies:load_fallback:1"] == 1
    assert stats.data["rank_copies:load:0"] == stats.data["rank_copies:load:1"] == 1
    assert "rank_copies:load_fallback:0" not in stats.data


def test_has_pending_push_work_v1_and_v2(make_scheduler: SchedulerFactory) -> None:
    v1 = make_scheduler()
    meta = StepDriver(v1).step([make_request("r", [Item(H)])]).meta
    assert not v1.has_pending_push_work(), "V1 empty steps never reach the workers"
    v1.update_connector_output(connector_output(SimulatedRanks().report(meta)))

    v2 = make_scheduler(v2=True)
    assert not v2.has_pending_push_work()
    meta = StepDriver(v2).step([make_request("r", [Item(H)])]).meta
    assert v2.has_pending_push_work() and v2.has_pending_push_work()  # a pure query
    v2.update_connector_output(connector_output(SimulatedRanks().report(meta)))
    assert not v2.has_pending_push_work()
    meta = StepDriver(v2).step([make_request("r2", [Item(H)])]).meta
    assert v2.has_pending_push_work(), "a load in flight"
    v2.update_connector_output(connector_output(SimulatedRanks().report(meta)))
    assert not v2.has_pending_push_work()


def test_shutdown_is_idempotent_and_stops_hits(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item(H))
    scheduler.shutdown()
    scheduler.shutdown()
    assert not _has(scheduler, H)
    assert not scheduler.has_pending_push_work()
    assert scheduler.request_finished(make_request("r", [Item(H)])) == (False, None)
    result = StepDriver(scheduler).step([make_request("r", [Item(H)])])
    assert result.meta.saves == {} and result.meta.loads == {}


class _ThreadedRemote:
    """A remote source whose own thread gives its lease back when it is stopped, the
    way ec-transfer-nixl's server thread does (`Leases.release_all` in its `finally`)."""

    def __init__(self, local: LocalEntries, lock: threading.RLock) -> None:
        self.local = local
        self._lock = lock
        self.released = False
        self.called_under_the_lock: bool | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._stop.wait()
        self.local.release([H])  # takes the scheduler's lock
        self.released = True

    def shutdown(self) -> None:
        # Whether the scheduler called us holding its lock is a fact, not a race:
        # it is read here instead of inferred from how long the join took.
        self.called_under_the_lock = self._lock._is_owned()  # type: ignore[attr-defined]
        self._stop.set()
        if not self.called_under_the_lock:  # else the thread cannot finish: do not wait
            self._thread.join(timeout=60)  # CI slack; it normally ends within milliseconds
        self.local.closed = True


def test_shutdown_lets_the_remote_sources_threads_give_their_leases_back(
    make_scheduler: SchedulerFactory,
) -> None:
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item(H))
    local = LocalEntries(
        scheduler.allocator,
        scheduler.lock,
        scheduler._availability.release_pin,
        scheduler._availability.stale.__contains__,
        lambda rows, cols: scheduler.layout.blocks_for(rows, cols, 4),
    )
    assert local.lease(H, 8, WIDTH)[0] == "ready"  # a peer's lease: one pin
    remote = _ThreadedRemote(local, scheduler.lock)
    scheduler.remote = remote  # type: ignore[assignment]
    scheduler.shutdown()
    assert remote.called_under_the_lock is False, "the source's thread would block on the lock"
    assert remote.released, "the source's thread gave its lease back before shutdown returned"


def test_region_full_of_held_entries_skips_saves_and_never_blocks(
    make_scheduler: SchedulerFactory,
) -> None:
    scheduler = make_scheduler(blocks=8)
    driver = StepDriver(scheduler)
    driver.step([make_request("1", [Item("a")])])  # 8 blocks, save in flight
    request = make_request("2", [Item("b")])
    assert scheduler.ensure_cache_available(request, 0)
    result = driver.step([request])
    assert result.meta.saves == {}
    assert scheduler.counters.saves_skipped_full == 1
    assert not _has(scheduler, "b")


def test_lru_eviction_through_the_scheduler(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler(blocks=16, ec_eviction_policy="lru")
    _save_and_report(scheduler, Item("a"))
    _save_and_report(scheduler, Item("b"))
    # Reload "a": it becomes the most recently used.
    meta = StepDriver(scheduler).step([make_request("r", [Item("a")])]).meta
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(meta)))
    _save_and_report(scheduler, Item("c"))
    assert "b" not in scheduler.allocator
    assert "a" in scheduler.allocator and "c" in scheduler.allocator
    assert scheduler.counters.evictions == 1


# --------------------------------------------------- upstream failure modes


def test_fm1_promised_entry_survives_a_same_request_save(make_scheduler: SchedulerFactory) -> None:
    """Upstream: a save for item X evicts entry Y that lookup(Y) had promised."""
    scheduler = make_scheduler(blocks=16)
    _save_and_report(scheduler, Item("y"))  # blocks 0-7, ready, evictable
    _save_and_report(scheduler, Item("z"))  # blocks 8-15, ready, evictable
    # Request with a new item X (needs 8 blocks: must evict) and the cached Y.
    # vLLM looks both up first, then allocates X (compute) before Y (load).
    result = StepDriver(scheduler).step([make_request("r", [Item("x"), Item("y")])])
    assert result.looked_up == {"x": False, "y": True}
    assert "y" in result.meta.loads, "the promised entry must still be loadable"
    assert "x" in result.meta.saves
    assert "z" not in scheduler.allocator, "the save evicted the unpromised entry"
    assert set(result.meta.saves["x"]).isdisjoint(result.meta.loads["y"][1])


@pytest.mark.parametrize(
    ("takers", "scheduled", "kept"),
    [(["r"], [], False), (["r"], ["r"], True), (["r", "s"], ["s"], True)],
    ids=["all-preempted", "taker-scheduled", "other-taker-scheduled"],
)
def test_a_load_whose_item_its_step_frees_is_withdrawn_unless_a_scheduled_request_takes_it(
    make_scheduler: SchedulerFactory, takers: list[str], scheduled: list[str], kept: bool
) -> None:
    """vLLM preempted every request the load is for and evicted the item in the same
    step: the workers would free it before the load lands, so the load is taken
    back (its pin released, its hit not counted). A request scheduled in the step
    that takes it (the encoder-decoder manager names the step before's items) keeps it."""
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item(H))
    assert _has(scheduler, H)
    for request_id in takers:
        scheduler.update_state_after_alloc(make_request(request_id, [Item(H)]), 0)
    output = scheduler_output()
    output.free_encoder_mm_hashes = [H]
    output.num_scheduled_tokens = dict.fromkeys(scheduled, 9)
    meta = scheduler.build_connector_meta(output)
    assert (H in meta.loads) is kept and (H in meta.runs) is kept
    entry = scheduler.allocator.get(H)
    assert entry is not None and entry.ready and entry.pins == int(kept)
    assert scheduler.counters.hits == scheduler.counters.loads_dispatched == int(kept)
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(meta)))
    assert entry.pins == 0 and not scheduler.flights


def test_fm1_unscheduled_promise_is_released_at_step_end(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler(blocks=8)
    _save_and_report(scheduler, Item("y"))
    result = StepDriver(scheduler).step([make_request("r", [Item("y")])], skip_alloc=["r"])
    assert result.looked_up == {"y": True} and result.meta.loads == {}
    entry = scheduler.allocator.get("y")
    assert entry is not None and entry.pins == 0 and entry.evictable


def test_an_item_whose_request_waits_is_counted_and_learned_once(
    make_scheduler: SchedulerFactory,
) -> None:
    """vLLM looks a waiting request's items up again every step (no KV blocks for it
    yet, say): the hit (encoder run avoided), the miss (encoder run) and the policy's
    request count come once, when vLLM schedules the item."""
    scheduler = make_scheduler(blocks=16)
    _save_and_report(scheduler, Item("y"))
    counters, sketch = scheduler.counters, scheduler.allocator.policy.sketch  # type: ignore[attr-defined]
    lookups, hits, seen = counters.lookups, counters.hits, sketch.estimate("y")
    driver = StepDriver(scheduler)
    waiting = make_request("r", [Item("y"), Item("n")])
    for _ in range(3):  # looked up, not scheduled
        result = driver.step([waiting], skip_alloc=["r"])
        assert result.looked_up == {"y": True, "n": False} and not result.meta.loads
    assert (counters.lookups, counters.hits, sketch.estimate("y")) == (lookups, hits, seen)
    meta = driver.step([waiting]).meta
    assert "y" in meta.loads and "n" in meta.saves
    assert (counters.lookups, counters.hits) == (lookups + 2, hits + 1)
    assert sketch.estimate("y") == seen + 1 and sketch.estimate("n") == 1
    stats = scheduler.stat_totals()
    assert stats["misses"] == stats["lookups"] - stats["hits"]


def test_a_waiting_requests_lookups_are_no_hits_to_the_policy(
    make_scheduler: SchedulerFactory,
) -> None:
    """Each step's lookup of a waiting request pins its ready item (a promise vLLM may
    not take up): the default policy must not count those pins as hits (a first
    sighting's trial paid off, the frequency side's sample), only the request once
    vLLM schedules it."""
    scheduler = make_scheduler(blocks=16)
    policy = scheduler.allocator.policy
    assert isinstance(policy, WTinyLFUPolicy)
    policy._set_recency_mode(False)
    _save_and_report(scheduler, Item("y"))
    assert "y" in policy._trial, "a first sighting saved, not hit yet"
    driver = StepDriver(scheduler)
    waiting = make_request("r", [Item("y")])
    for _ in range(3):
        assert driver.step([waiting], skip_alloc=["r"]).looked_up == {"y": True}
        assert "y" in policy._trial and policy._sample[2] == 0
    assert "y" in driver.step([waiting]).meta.loads
    assert "y" not in policy._trial
    # Its load not reported yet (the entry still pinned), y is asked for again: the
    # tier serves it, and the policy counts the hit (a pin that nests is no event).
    assert "y" in driver.step([make_request("r2", [Item("y")])]).meta.loads
    assert policy._sample[2] == min(policy._blocks["y"], policy._weight_cap)


@pytest.mark.parametrize(
    ("item", "counter", "needle"),
    [
        (Item("huge", embeds=100), "saves_skipped_oversize", "needs 100 blocks"),
        (Item("empty", embeds=0), "saves_skipped_empty", "no embeddings"),
        (Item("sound", modality="audio"), "saves_skipped_unmeasured", "'audio'"),
    ],
)
def test_fm2_unsaveable_items_warn_once_and_do_not_raise(
    make_scheduler: SchedulerFactory,
    ec_log: pytest.LogCaptureFixture,
    item: Item,
    counter: str,
    needle: str,
) -> None:
    scheduler = make_scheduler(blocks=64)
    driver = StepDriver(scheduler)
    for i in range(3):
        again = Item(f"{item.identifier}{i}", item.embeds, item.modality)
        result = driver.step([make_request(f"r{i}", [again])])
        assert result.meta.saves == {}
    assert getattr(scheduler.counters, counter) == 3
    warnings = [
        r for r in ec_log.records if r.levelno == logging.WARNING and needle in r.getMessage()
    ]
    assert len(warnings) == 1
    assert len(scheduler.allocator) == 0


def test_fm3_unreported_save_is_overdue_and_the_engine_can_idle(
    make_scheduler: SchedulerFactory, ec_log: pytest.LogCaptureFixture
) -> None:
    clock = [1000.0]
    scheduler = make_scheduler(v2=True, ec_report_timeout_steps=3, ec_report_timeout_s=5)
    scheduler.settlement.set_clock(lambda: clock[0])
    driver = StepDriver(scheduler)
    driver.step([make_request("r", [Item(H)])])  # never reported
    assert scheduler.has_pending_push_work()
    for _ in range(5):  # steps pass but not the time
        scheduler.build_connector_meta(scheduler_output())
    assert scheduler.has_pending_push_work(), "a fast burst of steps alone is not the bound"
    clock[0] += 10
    scheduler.build_connector_meta(scheduler_output())
    assert not scheduler.has_pending_push_work(), "the engine may idle"
    assert scheduler.counters.saves_reclaimed == 1
    assert any("is unreported after" in r.getMessage() for r in ec_log.records)
    entry = scheduler.allocator.get(H)
    assert entry is not None and not entry.ready, "its blocks stay held: the copy may still land"


def test_fm3_idle_time_alone_does_not_make_a_copy_overdue(
    make_scheduler: SchedulerFactory,
) -> None:
    clock = [0.0]
    scheduler = make_scheduler(ec_report_timeout_steps=3, ec_report_timeout_s=5)
    scheduler.settlement.set_clock(lambda: clock[0])
    meta = StepDriver(scheduler).step([make_request("r", [Item(H)])]).meta
    clock[0] += 3600  # an hour of idling: no steps reached the workers
    scheduler.build_connector_meta(scheduler_output(num_tokens=0))
    assert scheduler.counters.saves_reclaimed == 0
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(meta)))
    assert _has(scheduler, H)


def test_fm3_blocks_of_an_overdue_load_are_held_until_its_rank_settles(
    make_scheduler: SchedulerFactory,
) -> None:
    scheduler = make_scheduler(ec_report_timeout_steps=2, ec_report_timeout_s=0)
    _save_and_report(scheduler, Item(H), ranks=2)
    sim = SimulatedRanks(2)
    meta = StepDriver(scheduler).step([make_request("r", [Item(H)])]).meta
    scheduler.update_connector_output(connector_output(sim.report(meta, ranks=[0], waiting=[1])))
    for _ in range(4):
        step = scheduler.build_connector_meta(scheduler_output())
        report = sim.report(step, ranks=[0], waiting=[1])
        report.progress[-1] = (1, step.step, meta.step - 1)  # rank 1 still reads the load's blocks
        scheduler.update_connector_output(connector_output(report))
    entry = scheduler.allocator.get(H)
    assert entry is not None and entry.pins == 1 and not entry.evictable
    assert scheduler.counters.loads_reclaimed == 1
    assert scheduler.counters.loads_completed == 0, "one rank has not finished it"
    scheduler.update_connector_output(connector_output(sim.report(step, ranks=[1])))
    assert entry.pins == 0 and entry.evictable
    assert scheduler.counters.loads_completed == 1
    # The straggler's own report after it settled is ignored, not a double unpin.
    scheduler.update_connector_output(connector_output(sim.report(meta, ranks=[1])))
    assert entry.pins == 0


def test_fm3_a_rank_that_falls_silent_is_declared_gone(
    make_scheduler: SchedulerFactory, ec_log: pytest.LogCaptureFixture
) -> None:
    """A dead rank stops reporting while the others run on: its loads stop being waited for."""
    scheduler = make_scheduler(ec_report_timeout_steps=2, ec_report_timeout_s=0)
    _save_and_report(scheduler, Item(H), ranks=2)
    sim = SimulatedRanks(2)
    driver = StepDriver(scheduler)
    meta = driver.step([make_request("r", [Item(H)])]).meta
    entry = scheduler.allocator.get(H)
    assert entry is not None
    scheduler.update_connector_output(connector_output(sim.report(meta, ranks=[0])))
    for _ in range(3):  # the same report again and again: no step ran, nobody is silent
        scheduler.update_connector_output(connector_output(sim.report(meta, ranks=[0])))
    assert scheduler.settlement.ranks.gone == set() and entry.pins == 1
    for number in range(3):  # rank 0 runs three more steps, rank 1 says nothing
        step = scheduler.build_connector_meta(scheduler_output())
        scheduler.update_connector_output(connector_output(sim.report(step, ranks=[0])))
        assert entry.pins == (1 if number < 1 else 0), number
    assert scheduler.settlement.ranks.gone == {1}
    assert any("treated as gone" in r.getMessage() for r in ec_log.records)
    second = driver.step([make_request("r2", [Item(H)])]).meta
    scheduler.update_connector_output(connector_output(sim.report(second, ranks=[0])))
    assert entry.pins == 0, "one live rank left"
    # It comes back: live again, with a warning.
    scheduler.update_connector_output(connector_output(sim.report(second, ranks=[1])))
    assert scheduler.settlement.ranks.live == {0, 1}
    assert any("reports again" in r.getMessage() for r in ec_log.records)


def test_fm3_a_copy_slower_than_the_bound_keeps_its_blocks_until_it_lands(
    make_scheduler: SchedulerFactory,
) -> None:
    """The issue's corruption: save A overdue, its blocks reused for B, A lands late on B.

    Blocks of an overdue save are not reused while its rank has not settled
    past it; when its report does arrive, the entry becomes ready after all.
    """
    scheduler = make_scheduler(blocks=8, ec_report_timeout_steps=1, ec_report_timeout_s=0)
    driver = StepDriver(scheduler)
    slow = driver.step([make_request("a", [Item("A")])]).meta
    assert slow.saves["A"] == list(range(8)), "A takes the whole region"
    for _ in range(3):  # the rank runs on, its copy of A still in flight
        step = scheduler.build_connector_meta(scheduler_output())
        report = SimulatedRanks().report(step, settled=slow.step - 1)
        scheduler.update_connector_output(connector_output(report))
    assert scheduler.counters.saves_reclaimed == 1
    b = driver.step([make_request("b", [Item("B")])]).meta
    assert b.saves == {}, "no block of A may go to B while A's copy can still land"
    landed = SimulatedRanks().report(slow, settled=b.step)
    scheduler.update_connector_output(connector_output(landed))
    assert scheduler.allocator.get("A").ready  # type: ignore[union-attr]
    assert scheduler.counters.saves_completed == 1


def test_fm4_shape_mismatch_is_a_miss_and_drops_the_stale_entry(
    make_scheduler: SchedulerFactory, ec_log: pytest.LogCaptureFixture
) -> None:
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item(H, embeds=8))
    result = StepDriver(scheduler).step([make_request("r", [Item(H, embeds=6)])])
    assert result.looked_up == {H: False}
    assert result.meta.loads == {}
    assert result.meta.saves[H] == list(range(6)), "re-encoded and saved with the new shape"
    assert scheduler.counters.stale_dropped == 1
    assert any("reused multimodal UUID" in r.getMessage() for r in ec_log.records)


def test_fm4_pinned_stale_entry_is_dropped_after_its_load(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item(H, embeds=8))
    driver = StepDriver(scheduler)
    in_flight = driver.step([make_request("r1", [Item(H, embeds=8)])]).meta
    result = driver.step([make_request("r2", [Item(H, embeds=4)])])
    assert result.looked_up == {H: False}
    assert result.meta.loads == {} and result.meta.saves == {}
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(in_flight)))
    assert H not in scheduler.allocator


def test_fm4_a_stale_entry_promised_to_a_passed_over_request_is_a_miss(
    make_scheduler: SchedulerFactory,
) -> None:
    """vLLM looks request r1's item up (promised), then passes r1 over this step (its
    chunk came to no tokens) and goes on to r2, whose item of the same UUID has
    another row count: r2's lookup is a miss, not a load of r1's rows."""
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item(H, embeds=8))
    r1, r2 = make_request("r1", [Item(H, embeds=8)]), make_request("r2", [Item(H, embeds=4)])
    assert scheduler.ensure_cache_available(r1, 0)
    assert scheduler.has_cache_item(H)  # r1 is not scheduled: no update_state_after_alloc
    assert scheduler.ensure_cache_available(r2, 0)
    assert not scheduler.has_cache_item(H), "the 8-row entry would be loaded for 4 rows"
    scheduler.update_state_after_alloc(r2, 0)  # computed
    meta = scheduler.build_connector_meta(scheduler_output())
    assert meta.loads == {}
    assert meta.save_shapes == {H: (4, WIDTH)}, "re-encoded and saved with its own shape"
    assert scheduler.counters.stale_dropped == 1


def test_fm4_a_load_dispatched_this_step_does_not_serve_a_reused_uuid_of_other_rows(
    make_scheduler: SchedulerFactory,
) -> None:
    """r1's 8-row item is loaded this step; r2 reuses its UUID for 4 rows. vLLM
    refuses r2 itself (same identifier, other size, same step) unless r1 was
    preempted in the same step (test_vllm_scheduler.py reaches that): the scheduler
    half must not answer r2's lookup with r1's load."""
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item(H, embeds=8))
    r1, r2 = make_request("r1", [Item(H, embeds=8)]), make_request("r2", [Item(H, embeds=4)])
    assert scheduler.ensure_cache_available(r1, 0) and scheduler.has_cache_item(H)
    scheduler.update_state_after_alloc(r1, 0)  # r1's load is dispatched
    assert scheduler.ensure_cache_available(r2, 0)  # finds 8 rows where 4 are needed
    assert not scheduler.has_cache_item(H), "r1's 8-row load would serve r2's 4 rows"
    meta = scheduler.build_connector_meta(scheduler_output())
    assert list(meta.loads) == [H] and meta.loads[H][2] == (8, WIDTH), "r1 keeps its load"


def _line_events(scheduler: ECCPUScheduler, requests: list[list[Item]]) -> int:
    count = 0

    def tracer(frame: object, event: str, arg: object) -> object:
        nonlocal count
        count += 1
        return tracer

    driver = StepDriver(scheduler)
    sim = SimulatedRanks()
    # A collection during the trace would run other tests' finalizers (a zmq
    # socket's __del__, say) in this thread and count their lines too.
    gc.collect()
    gc.disable()
    sys.settrace(tracer)
    try:
        for i, items in enumerate(requests):
            meta = driver.step([make_request(f"q{i}", items)]).meta
            scheduler.update_connector_output(connector_output(sim.report(meta)))
    finally:
        sys.settrace(None)
        gc.enable()
    return count


def test_fm5_step_cost_does_not_grow_with_region_or_entries(
    make_scheduler: SchedulerFactory,
) -> None:
    """Count executed Python lines for identical steps on a tiny and a huge cache.

    Both use the `lru` policy: the default policy's branches follow its own
    state (window share, admission duels), which differs between a 64-block
    and a 2^24-block pool whatever the cost; its per-event bound is tested in
    ec-core's test_policy_invariants.py.
    """
    small = make_scheduler(blocks=64, ec_eviction_policy="lru")
    _save_and_report(small, Item("hot"))
    big = make_scheduler(blocks=1 << 24, ec_eviction_policy="lru")
    for i in range(2000):
        _save_and_report(big, Item(f"cold{i}"))
    _save_and_report(big, Item("hot"))
    workload = [[Item("hot"), Item("new1")], [Item("new2")], [Item("hot")]]
    small_events = _line_events(small, workload)
    big_events = _line_events(big, workload)
    assert small_events > 100, "the trace must have seen the steps"
    assert big_events == small_events, (small_events, big_events)


def test_stats_are_deltas_with_gauges_and_worker_figures(make_scheduler: SchedulerFactory) -> None:
    scheduler = make_scheduler(blocks=64)
    assert scheduler.get_ec_connector_stats() is None, "nothing happened yet"
    meta = StepDriver(scheduler).step([make_request("r", [Item(H)])]).meta
    report = SimulatedRanks().report(meta)
    report.stats = {"bytes_saved": 4096.0, "save_copy_seconds": 0.002}
    scheduler.update_connector_output(connector_output(report))
    stats = scheduler.get_ec_connector_stats()
    assert stats is not None
    assert stats.data["saves"] == 1
    assert stats.data["lookups"] == stats.data["misses"] == 1
    assert stats.data["bytes_saved"] == 4096.0
    assert stats.data["region_blocks"] == 64
    assert stats.data["region_used_blocks"] == 8
    assert stats.data["region_entries"] == 1
    assert stats.data["policy_lru_mode"] == 1.0, "wtinylfu starts evicting as plain LRU"
    assert "hits" not in stats.data, "only counters that moved"
    assert "policy_mode_changes" not in stats.data, "its mode has not changed"
    assert scheduler.get_ec_connector_stats() is None, "deltas are handed over once"
    meta = StepDriver(scheduler).step([make_request("r2", [Item(H)])]).meta
    assert scheduler.get_ec_connector_stats().data["hits"] == 1  # type: ignore[union-attr]
    held = scheduler.stat_totals()["region_held_entries"]
    assert held == 1, "a load in flight holds its entry"


def test_aggregated_log_line_of_data_parallel_engines_sums_their_gauges(
    make_scheduler: SchedulerFactory, role_configs: dict[str, VllmConfig]
) -> None:
    """`--aggregate-engine-logging` with two data-parallel engines: vLLM folds both
    engines' stats into one "EC Transfer metrics" line. Each engine has a region of
    its own, so the line's region gauges cover both, not the last one that reported."""
    from vllm.v1.metrics.loggers import AggregatedLoggingStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    config = role_configs["ec_both"]
    first = make_scheduler(blocks=64)  # data-parallel rank 0
    rank1 = copy.deepcopy(config)
    rank1.parallel_config.data_parallel_index = 1
    engines = [first, ECCPUScheduler(rank1, layout=first.layout)]
    for index, items in enumerate(([Item("a"), Item("b")], [Item("c")])):
        meta = StepDriver(engines[index]).step([make_request(f"r{index}", items)]).meta
        engines[index].update_connector_output(connector_output(SimulatedRanks().report(meta)))
    front_end = AggregatedLoggingStatLogger(config, engine_indexes=[0, 1])
    for index, engine in enumerate(engines):
        stats = engine.get_ec_connector_stats()
        assert stats is not None
        front_end.record(SchedulerStats(ec_connector_stats=stats.data), None, engine_idx=index)
    lines: list[str] = []
    front_end.ec_connector_logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    figures = {
        name: float(value)
        for name, value in (part.split("=") for part in lines[0].split(": ", 1)[1].split(", "))
    }
    assert figures["saves"] == 3
    assert figures["region_entries"] == 3, figures
    assert figures["region_blocks"] == 128, figures
    assert figures["region_used_blocks"] == 24, figures  # 3 entries of 8 blocks
    assert figures["policy_lru_mode"] == 2, figures  # both engines' policies still LRU-like


def test_overdue_warnings_are_rate_limited(
    make_scheduler: SchedulerFactory, ec_log: pytest.LogCaptureFixture
) -> None:
    scheduler = make_scheduler(ec_report_timeout_steps=1, ec_report_timeout_s=0)
    StepDriver(scheduler).step([make_request("r", [Item("a"), Item("b"), Item("c")])])
    for _ in range(3):
        scheduler.build_connector_meta(scheduler_output())
    assert scheduler.counters.saves_reclaimed == 3
    warnings = [r for r in ec_log.records if "is unreported after" in r.getMessage()]
    assert len(warnings) == 1, "one line per period, not one per copy"


class _RecordingRemote:
    """A remote source that only records what the scheduler asks it for."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int, int]] = []

    def wants(self, request: object, missing: list[object]) -> bool:
        self.asked.extend((w.key, w.rows, w.cols) for w in missing)  # type: ignore[attr-defined]
        return False


def test_items_are_asked_of_peers_in_the_width_their_modality_is_saved_in(
    make_scheduler: SchedulerFactory,
) -> None:
    """An encoder wider than the LM embedding (DeepStack) is saved, and so held by
    a producer, in its measured width: a fetch must ask for that shape."""
    scheduler = make_scheduler()
    scheduler._widths["image"] = 4 * WIDTH  # measured: four times the embedding width
    remote = _RecordingRemote()
    scheduler.remote = remote  # type: ignore[assignment]
    request = make_request("r", [Item(H, embeds=8)])
    assert scheduler.ensure_cache_available(request, 0)
    assert remote.asked == [(H, 8, 4 * WIDTH)]
    scheduler.remote = None
    StepDriver(scheduler).step([request])
    assert scheduler.allocator.get(H).shape == (8, 4 * WIDTH), "what a local save holds"


def test_fm4_a_stale_entry_held_by_a_load_is_counted_once(
    make_scheduler: SchedulerFactory,
) -> None:
    """While its load is in flight, a stale entry stays; the requests that keep asking
    for the item's other shape meanwhile do not count it as dropped again."""
    scheduler = make_scheduler()
    _save_and_report(scheduler, Item(H, embeds=8))
    driver = StepDriver(scheduler)
    in_flight = driver.step([make_request("r1", [Item(H, embeds=8)])]).meta
    for number in range(3):  # the same item with another shape, step after step
        result = driver.step([make_request(f"r{number + 2}", [Item(H, embeds=4)])])
        assert result.looked_up == {H: False}
    assert scheduler.counters.stale_dropped == 1, "one entry was dropped, once"
    assert scheduler.stat_totals()["stale_dropped"] == 1
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(in_flight)))
    assert H not in scheduler.allocator
    assert scheduler.counters.stale_dropped == 1


def test_an_items_row_count_honours_its_embedding_mask() -> None:
    """Rows are counted without vLLM's cached cumulative sum when every placeholder
    token is an embedding, and from the mask when one is given (some tokens are not)."""
    import torch
    from vllm.multimodal.inputs import PlaceholderRange

    from ec_scheduler.availability import num_embeds

    plain = PlaceholderRange(offset=3, length=9)
    masked = PlaceholderRange(
        offset=3, length=5, is_embed=torch.tensor([False, True, False, True, True])
    )
    assert num_embeds(plain) == 9 and "embeds_cumsum" not in vars(plain)
    assert num_embeds(masked) == masked.get_num_embeds() == 3


def test_invalidate_forgets_every_entry_and_those_in_use_once_their_copies_end(
    make_scheduler: SchedulerFactory,
) -> None:
    """After vLLM resets its encoder cache (new model weights) no entry saved before
    is loaded again: a free one goes at once, one being loaded or saved when its
    copy is reported, and the same items saved afterwards are loadable again."""
    scheduler = make_scheduler(blocks=64)
    _save_and_report(scheduler, Item("free"), Item("loading"))
    driver = StepDriver(scheduler)
    step = driver.step([make_request("r", [Item("loading"), Item("saving")])])
    assert list(step.meta.loads) == ["loading"] and list(step.meta.saves) == ["saving"]
    scheduler.invalidate()  # with that load and that save in flight
    assert "free" not in scheduler.allocator
    assert not any(_has(scheduler, key) for key in ("free", "loading", "saving"))
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(step.meta)))
    assert len(scheduler.allocator) == 0 and not scheduler._availability.stale
    assert scheduler.allocator.num_free_blocks == 64
    _save_and_report(scheduler, Item("free"), Item("saving"))  # encoded with the new weights
    assert _has(scheduler, "free") and _has(scheduler, "saving")
