"""The scheduler half under vLLM's real v1 Scheduler (`ectools.vllm_scheduler`).

vLLM decides the call order here: chunked prefill, encoder budget and encoder
cache limits, KV-block preemption, aborts, and (`AsyncSteps`) async scheduling,
where a step is scheduled before the previous one reports. A simulated worker
checks that every item a step gathers holds that item's rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from ec_core.metadata import ECCPUConnectorMetadata
from ec_scheduler.remote import Wanted
from ectools.vllm_scheduler import (
    AsyncSteps,
    SimulatedWorker,
    mm_request,
    real_scheduler,
    run_step,
    scheduler_half,
)


def _drain(scheduler: Scheduler, worker: SimulatedWorker, *, v2: bool = False) -> None:
    for _ in range(400):
        if not scheduler.has_requests():
            return
        run_step(scheduler, worker, v2=v2)


def _random_request(
    rng: random.Random, number: int, sizes: dict[str, int], *, repeats: bool
) -> Request:
    """Request `r{number}` with one to three of the items in `sizes` (the same
    item more than once where `repeats`), at random offsets and settings."""
    if repeats:
        items = [rng.choice(sorted(sizes)) for _ in range(rng.randint(1, 3))]
    else:
        items = rng.sample(sorted(sizes), rng.randint(1, 3))
    return mm_request(
        f"r{number}",
        [(key, sizes[key]) for key in items],
        text=rng.randint(0, 5),
        gap=rng.randint(0, 3),
        max_tokens=rng.randint(1, 16),
        priority=rng.randint(0, 3),
    )


def _maybe_abort(scheduler: Scheduler, rng: random.Random) -> None:
    """Now and then (one time in twenty), the client aborts a random request."""
    if scheduler.requests and rng.random() < 0.05:
        victim = rng.choice(sorted(scheduler.requests))
        scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)


def test_a_passed_over_requests_promise_does_not_load_its_rows_for_a_reused_uuid(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """Running request A's chunk reaches item X (looked up: a hit, promised); vLLM
    then passes A over this step (here because A reuses another UUID, Z, for two
    sizes; a multi-token-prediction lookahead does it too). New request B uses X's
    UUID for a 4-row item: its lookup must be a miss, not a load of X's 8 rows."""
    scheduler = real_scheduler(tiny_model_dir, tmp_path, max_batched_tokens=16)
    worker = SimulatedWorker()
    scheduler.add_request(mm_request("w", [("X", 8)]))
    _drain(scheduler, worker)
    # Push X out of vLLM's own encoder cache (32 rows), so X must come from the region.
    scheduler.add_request(mm_request("f", [("F1", 16), ("F2", 16)]))
    _drain(scheduler, worker)
    entry = scheduler_half(scheduler).allocator.get("X")
    assert entry is not None and entry.ready and entry.shape == (8, 128)
    assert "X" not in scheduler.encoder_cache_manager.cached

    scheduler.add_request(mm_request("A", [("X", 8), ("Z", 2), ("Z", 1)], text=18, gap=0))
    first = run_step(scheduler, worker)
    assert dict(first.num_scheduled_tokens) == {"A": 16}, "A's first chunk is text"
    scheduler.add_request(mm_request("B", [("X", 4)]))
    second = run_step(scheduler, worker)
    assert "A" not in second.num_scheduled_tokens
    _drain(scheduler, worker)
    assert worker.errors == []
    assert second.scheduled_encoder_inputs == {"B": [0]}, "B's X is encoded"


def test_a_load_for_a_request_preempted_in_the_same_step_is_not_served_to_a_reused_uuid(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """Priority scheduling, one step: A's chunk reaches item X (8 rows, in the
    region): a hit, its load dispatched. C then lacks KV blocks and preempts A,
    which drops vLLM's reference to X; B's item Y evicts X from vLLM's encoder
    cache, so vLLM's own row-count check no longer sees it when B asks for its X,
    a 4-row item under the same UUID. B's X must be encoded, not served the load
    of A's 8 rows."""
    scheduler = real_scheduler(
        tiny_model_dir,
        tmp_path,
        encoder_budget=16,
        encoder_cache=16,
        kv_blocks=37,
        max_batched_tokens=64,
        policy="priority",
        long_prefill=16,
    )
    worker = SimulatedWorker()
    scheduler.add_request(mm_request("A", [("P", 8), ("X", 8)], text=80, gap=0, priority=4))
    assert dict(run_step(scheduler, worker).num_scheduled_tokens) == {"A": 64}
    scheduler.add_request(mm_request("C", [], text=60))
    scheduler.add_request(mm_request("B", [("Y", 12), ("X", 4)], text=16, gap=0))
    # W encodes and saves X (8 rows) and Z; both are freed in vLLM's cache after this step.
    scheduler.add_request(mm_request("W", [("X", 8), ("Z", 8)], text=0, gap=0, max_tokens=1))
    assert run_step(scheduler, worker).scheduled_encoder_inputs == {"W": [0, 1]}
    entry = scheduler_half(scheduler).allocator.get("X")
    assert entry is not None and entry.ready and entry.shape == (8, 128)

    third = run_step(scheduler, worker)
    assert third.preempted_req_ids == {"A"}
    meta = third.ec_connector_metadata
    assert isinstance(meta, ECCPUConnectorMetadata)
    assert "X" in meta.loads, "A's X was a hit before A was preempted"
    assert "B" in third.num_scheduled_tokens
    _drain(scheduler, worker)
    assert worker.errors == []
    assert third.scheduled_encoder_inputs == {"B": [0, 1]}, "B's X is encoded"


def _preempting_traffic(
    tiny_model_dir: str, tmp_path: Path, *, kv_blocks: int, async_scheduling: bool = False
) -> tuple[Scheduler, SimulatedWorker, Callable[[], SchedulerOutput | None], Callable[[], None]]:
    """Priority scheduling: A (lowest priority) runs a long text prefix before items P
    and X; then C, B (item Y, 12 rows) and W (X and Z, both saved and then freed in
    vLLM's encoder cache of 16 rows) arrive. Returns the scheduler, the worker, what
    runs one engine step and what runs the engine until it idles."""
    scheduler = real_scheduler(
        tiny_model_dir,
        tmp_path,
        encoder_budget=16,
        encoder_cache=16,
        kv_blocks=kv_blocks,
        max_batched_tokens=64,
        policy="priority",
        long_prefill=16,
        async_scheduling=async_scheduling,
    )
    worker = SimulatedWorker()
    steps = AsyncSteps(scheduler, worker)

    def step() -> SchedulerOutput | None:
        return steps.step() if async_scheduling else run_step(scheduler, worker)

    def drain() -> None:
        if async_scheduling:
            _async_drain(steps)
        else:
            _drain(scheduler, worker)

    scheduler.add_request(mm_request("A", [("P", 8), ("X", 8)], text=80, gap=0, priority=4))
    step()
    scheduler.add_request(mm_request("C", [], text=60))
    scheduler.add_request(mm_request("B", [("Y", 12)], text=16, gap=0))
    scheduler.add_request(mm_request("W", [("X", 8), ("Z", 8)], text=0, gap=0, max_tokens=1))
    return scheduler, worker, step, drain


@pytest.mark.parametrize(
    ("async_scheduling", "kv_blocks"), [(False, 37), (True, 42)], ids=["sync", "async"]
)
def test_a_load_for_a_request_preempted_in_the_same_step_is_not_left_untracked(
    tiny_model_dir: str, tmp_path: Path, async_scheduling: bool, kv_blocks: int
) -> None:
    """One step: A's chunk reaches P and X; P's allocation evicts W's X from vLLM's
    encoder cache, so X is looked up and its load dispatched. C then lacks KV blocks
    and preempts A, which drops vLLM's references to P and X, and B's item Y evicts
    both: the step tells the worker to free X, which it does before it loads. The
    load must not land: nothing would free it (A is aborted here and X never comes
    back), one encoder output of device memory leaked per occurrence."""
    scheduler, worker, step, drain = _preempting_traffic(
        tiny_model_dir, tmp_path, kv_blocks=kv_blocks, async_scheduling=async_scheduling
    )
    half = scheduler_half(scheduler)
    with mock.patch.object(half, "_dispatch_load", wraps=half._dispatch_load) as dispatch:
        for _ in range(4):
            output = step()
            if output is not None and output.preempted_req_ids:
                break
    assert output is not None and output.preempted_req_ids == {"A"}
    dispatch.assert_called_once_with("X", "X")  # A's X was a hit before A was preempted
    assert output.scheduled_encoder_inputs == {"B": [0]}
    assert "X" in output.free_encoder_mm_hashes
    assert "X" not in scheduler.encoder_cache_manager.cached
    scheduler.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    drain()
    assert worker.errors == []
    assert "X" not in worker.cache
    assert [e.key for e in half.allocator if not e.evictable] == []
    assert not half.flights and not half._availability.promised
    assert half.counters.hits == half.counters.loads_dispatched == 0


def test_a_load_of_an_item_evicted_earlier_in_the_same_step_is_kept(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """As above with KV blocks to spare: A is not preempted. X, still in vLLM's
    encoder cache before the step, is evicted by A's P and then loaded for A in the
    same step; vLLM does not name it among the step's freed items, and A gathers
    the loaded rows."""
    scheduler, worker, step, drain = _preempting_traffic(tiny_model_dir, tmp_path, kv_blocks=64)
    step()
    assert "X" in scheduler.encoder_cache_manager.cached
    third = step()
    assert third is not None and not third.preempted_req_ids
    meta = third.ec_connector_metadata
    assert isinstance(meta, ECCPUConnectorMetadata) and "X" in meta.loads
    assert third.scheduled_encoder_inputs["A"] == [0]
    assert "X" not in third.free_encoder_mm_hashes
    drain()
    assert worker.errors == []
    assert scheduler_half(scheduler).counters.hits == 1


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [1, 2])
def test_random_traffic_gathers_the_right_rows_and_holds_nothing_after(
    tiny_model_dir: str, tmp_path: Path, v2: bool, policy: str, seed: int
) -> None:
    """Chunked prefill, small encoder budget and cache, KV-block preemption, aborts
    and copies that land late: every gather finds its own rows, and once the
    traffic is over no entry stays pinned or unsaved, and no promise is left."""
    rng = random.Random(seed)
    scheduler = real_scheduler(
        tiny_model_dir,
        tmp_path,
        encoder_budget=24,
        encoder_cache=32,
        kv_blocks=20,
        max_batched_tokens=12,
        max_seqs=3,
        policy=policy,
        v2=v2,
        region_bytes=40 * 128 * 4,  # 40 rows: the region evicts
    )
    half = scheduler_half(scheduler)
    assert half.layout.num_blocks == 40
    worker = SimulatedWorker(rng, max_delay=2)
    sizes = {f"I{i}": rng.randint(2, 16) for i in range(8)}
    preempted = 0
    for number in range(100):
        if rng.random() < 0.4:
            scheduler.add_request(_random_request(rng, number, sizes, repeats=False))
        _maybe_abort(scheduler, rng)
        if scheduler.has_requests():
            preempted += bool(run_step(scheduler, worker, v2=v2).preempted_req_ids)
        half.allocator.check()
    _drain(scheduler, worker, v2=v2)
    for tail in range(4):  # on V1 reports come only with steps that have tokens
        scheduler.add_request(mm_request(f"tail{tail}", [], max_tokens=1))
        _drain(scheduler, worker, v2=v2)
    assert worker.errors == []
    assert half.counters.loads_dispatched > 0 and preempted > 0
    assert [e.key for e in half.allocator if not e.evictable] == []
    assert not half.flights and not half._availability.promised


def _async_drain(steps: AsyncSteps) -> None:
    for _ in range(800):
        if not steps.busy:
            return
        steps.step()
    raise AssertionError("the engine never went idle")


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(6))
def test_async_scheduling_random_traffic_gathers_the_right_rows(
    tiny_model_dir: str, tmp_path: Path, v2: bool, policy: str, seed: int
) -> None:
    """Under async scheduling (step N+1 scheduled before step N's report is
    applied): chunked prefill, small encoder budget and cache, KV preemption,
    aborts, late copies, items shared by requests and UUIDs reused with another
    row count. Every gather finds its own rows, and nothing is held after."""
    rng = random.Random(seed)
    scheduler = real_scheduler(
        tiny_model_dir,
        tmp_path,
        encoder_budget=24,
        encoder_cache=32,
        kv_blocks=20,
        max_batched_tokens=12,
        max_seqs=3,
        policy=policy,
        v2=v2,
        region_bytes=40 * 128 * 4,
        async_scheduling=True,
    )
    half = scheduler_half(scheduler)
    worker = SimulatedWorker(rng, max_delay=3)
    steps = AsyncSteps(scheduler, worker, v2=v2)
    sizes = {f"I{i}": rng.randint(2, 16) for i in range(8)}
    preempted = 0
    for number in range(150):
        if rng.random() < 0.05:  # a client reuses a UUID for an item of another size
            sizes[rng.choice(sorted(sizes))] = rng.randint(2, 16)
        if rng.random() < 0.4:
            scheduler.add_request(_random_request(rng, number, sizes, repeats=True))
        _maybe_abort(scheduler, rng)
        if steps.busy:
            output = steps.step()
            preempted += bool(output is not None and output.preempted_req_ids)
        half.allocator.check()
    _async_drain(steps)
    for tail in range(4):  # on V1 reports come only with steps that have tokens
        scheduler.add_request(mm_request(f"tail{tail}", [], max_tokens=1))
        _async_drain(steps)
    assert worker.errors == []
    # Whether a reused UUID meets an entry the pool still holds depends on what
    # the eviction policy kept (with 6 seeds some runs never do); the stale path
    # itself is pinned by test_scheduler.py's stale-entry tests.
    assert half.counters.loads_dispatched > 0
    assert preempted > 0
    assert [e.key for e in half.allocator if not e.evictable] == []
    assert not half.flights and not half._availability.promised and not half._availability.stale


def test_vllms_encoder_cache_reset_forgets_the_region_too(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """vLLM resets its encoder cache when the model's weights change, and tells no
    EC connector: the connector wraps that reset, so an item saved before it is
    encoded again afterwards, not loaded with the old weights' rows."""
    scheduler = real_scheduler(tiny_model_dir, tmp_path, max_batched_tokens=16)
    worker = SimulatedWorker()
    scheduler.add_request(mm_request("before", [("X", 8)]))
    _drain(scheduler, worker)
    scheduler.add_request(mm_request("evict", [("F1", 16), ("F2", 16)]))
    _drain(scheduler, worker)  # X leaves vLLM's own encoder cache; the region keeps it
    half = scheduler_half(scheduler)
    assert half.allocator.get("X") is not None
    scheduler.reset_encoder_cache()
    worker.cache.clear()  # EngineCore.reset_encoder_cache resets the workers' caches too
    assert half.allocator.get("X") is None
    scheduler.add_request(mm_request("after", [("X", 8)]))
    first = run_step(scheduler, worker)
    assert first.scheduled_encoder_inputs == {"after": [0]}, "X is encoded again"
    _drain(scheduler, worker)
    assert worker.errors == [] and half.counters.hits == 0


def _metadata_only(request: Request) -> Request:
    """`request` with each item given by metadata alone (no input for the encoder)."""
    for feature in request.mm_features:
        feature.data = None
    return request


def test_an_item_without_input_that_no_one_holds_fails_its_request_not_the_engine(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """An EC consumer accepts items given by metadata alone. One the region does not
    hold must never reach the encoder (the model runner, and the engine, would
    fail): its request is handed to vLLM as unavailable and finished with an error,
    and the next request is served."""
    scheduler = real_scheduler(tiny_model_dir, tmp_path)
    worker = SimulatedWorker()
    scheduler.add_request(_metadata_only(mm_request("M", [("X", 8)])))
    output = run_step(scheduler, worker)
    assert "M" not in output.scheduled_encoder_inputs
    assert "M" not in scheduler.requests  # finished with an error
    scheduler.add_request(mm_request("A", [("Y", 8)]))
    _drain(scheduler, worker)
    assert worker.errors == []
    assert scheduler_half(scheduler).take_unavailable_requests() == set()


def test_an_item_without_input_is_served_from_the_region_or_vllms_own_cache(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """Once an item is in the region (or in vLLM's encoder cache), a request that
    gives it by metadata alone is served like any other."""
    scheduler = real_scheduler(tiny_model_dir, tmp_path)
    worker = SimulatedWorker()
    scheduler.add_request(mm_request("A", [("X", 8)]))
    _drain(scheduler, worker)
    # vLLM's encoder cache still holds X: served from there.
    assert "X" in scheduler.encoder_cache_manager.cached
    scheduler.add_request(_metadata_only(mm_request("B", [("X", 8)])))
    _drain(scheduler, worker)
    half = scheduler_half(scheduler)
    assert half.take_unavailable_requests() == set()
    # Gone from vLLM's cache, X is loaded from the region.
    scheduler.reset_encoder_cache()  # also forgets the region: save X again
    scheduler.add_request(mm_request("C", [("X", 8)]))
    _drain(scheduler, worker)
    scheduler.encoder_cache_manager.reset()
    scheduler.add_request(_metadata_only(mm_request("D", [("X", 8)])))
    output = run_step(scheduler, worker)
    meta = output.ec_connector_metadata
    assert isinstance(meta, ECCPUConnectorMetadata) and "X" in meta.loads
    _drain(scheduler, worker)
    assert worker.errors == []
    assert half.counters.hits == 1


def test_an_item_without_input_the_region_holds_is_promised_when_checked(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """Between `ensure_cache_available` and vLLM's lookup of the item, the fetcher
    thread may reserve blocks for a fetch, evicting what is evictable: an item without
    input found in the region is pinned when it is checked, so the lookup still finds
    it (else it would go to the encoder with no input)."""
    scheduler = real_scheduler(tiny_model_dir, tmp_path)
    worker = SimulatedWorker()
    scheduler.add_request(mm_request("A", [("X", 8)]))
    _drain(scheduler, worker)
    scheduler.encoder_cache_manager.reset()
    half = scheduler_half(scheduler)
    request = _metadata_only(mm_request("B", [("X", 8)]))
    assert half.ensure_cache_available(request, 0)
    allocator = half.allocator
    free = allocator.num_free_blocks + allocator.num_evictable_blocks
    assert allocator.alloc("fetched", free, force=True) is not None  # evicts what it can
    assert half.has_cache_item("X"), "X was evicted between the check and the lookup"


def _chunk(request_id: str, items: list[tuple[str, int]], *, resumable: bool = True) -> Request:
    """A chunk of a streaming-input session (vLLM's resumable request): `mm_request`'s."""
    request = mm_request(request_id, items)
    request.resumable = resumable
    return request


def test_a_streaming_sessions_next_chunk_offers_and_saves_its_new_items(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """A streaming-input session keeps its request id, and vLLM extends its
    `mm_features` with each chunk's media. The next chunk's new item is handled
    like a new request's: offered to the remote source as missing (for the same
    request id, now with more items), saved here, and gathered right."""
    scheduler = real_scheduler(tiny_model_dir, tmp_path)
    worker = SimulatedWorker()
    half = scheduler_half(scheduler)
    asked: list[tuple[str, list[str], int]] = []

    def wants(request: Request, missing: list[Wanted]) -> bool:
        asked.append((request.request_id, [w.key for w in missing], len(request.mm_features)))
        return False

    half.remote = mock.Mock(wants=wants, request_finished=lambda request: None, stat_totals=dict)
    scheduler.add_request(_chunk("S", [("X", 8)]))
    for _ in range(20):
        run_step(scheduler, worker)
    session = scheduler.requests["S"]
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert asked[0] == ("S", ["X"], 1)
    assert half.allocator.get("X") is not None, "X was saved"
    asked.clear()
    scheduler.add_request(_chunk("S", [("Y", 8)]))  # the next chunk adds Y
    output = run_step(scheduler, worker)
    assert asked[0] == ("S", ["Y"], 2), "Y is offered like a new request's item"
    meta = output.ec_connector_metadata
    assert isinstance(meta, ECCPUConnectorMetadata) and "Y" in meta.saves
    scheduler.add_request(_chunk("S", [], resumable=False))  # the session ends
    _drain(scheduler, worker)
    assert "S" not in scheduler.requests
    assert worker.errors == []


@pytest.mark.parametrize("evicted", [True, False], ids=["oldest", "not-oldest"])
def test_an_item_without_input_that_vllm_evicts_for_an_earlier_item_of_its_request(
    tiny_model_dir: str, tmp_path: Path, evicted: bool
) -> None:
    """vLLM's encoder cache (32 rows) holds B and C, both unreferenced; the region
    does not hold B. A request gives new item A (16 rows) with its input, then B by
    metadata alone. Scheduling it, vLLM makes room for A by evicting its oldest
    unreferenced item: when that is B, vLLM then finds B missing, and B must not
    be scheduled for the encoder (it has no input: the model runner, and the
    engine, would fail); the request fails instead. When C goes, B is served."""
    scheduler = real_scheduler(tiny_model_dir, tmp_path)
    worker = SimulatedWorker()
    order = [("B", 16), ("C", 16)] if evicted else [("C", 16), ("B", 16)]
    scheduler.add_request(mm_request("w", order))
    _drain(scheduler, worker)
    assert list(scheduler.encoder_cache_manager.freeable) == [key for key, _ in order]
    half = scheduler_half(scheduler)
    half.allocator.drop("B")  # gone from the region (evicted there by other items)
    request = mm_request("R", [("A", 16), ("B", 16)])
    request.mm_features[1].data = None  # B: metadata alone
    scheduler.add_request(request)
    output = run_step(scheduler, worker)
    assert output.scheduled_encoder_inputs.get("R", []) in ([], [0]), "B went to the encoder"
    assert ("R" not in scheduler.requests) is evicted  # failed, or scheduled
    _drain(scheduler, worker)
    assert worker.errors == []
    assert half.take_unavailable_requests() == set()


def test_salted_requests_through_vllms_scheduler_see_only_their_own_salt(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """vLLM's real scheduler calls `ensure_cache_available(request)` before it looks up
    that request's items by identifier alone: the same image from salts A and B is
    encoded and saved once per salt, A again loads A's entry, and an unsalted request
    (no salt: its own party) sees neither. vLLM's own encoder cache keys by identifier,
    so it is emptied between the requests (as it is once another item evicts one)."""
    scheduler = real_scheduler(tiny_model_dir, tmp_path)
    worker = SimulatedWorker()
    half = scheduler_half(scheduler)
    keys = half.tier_keys

    def serve(request_id: str, salt: str | None) -> None:
        scheduler.encoder_cache_manager.reset()
        worker.cache.clear()
        scheduler.add_request(mm_request(request_id, [("X", 8)], cache_salt=salt))
        _drain(scheduler, worker)

    serve("A1", "salt-A")
    serve("B1", "salt-B")
    assert half.counters.hits == 0 and half.counters.saves_completed == 2
    key_a, key_b = (f"X|salt:{keys.digest(salt)}" for salt in ("salt-A", "salt-B"))
    assert {entry.key for entry in half.allocator} == {key_a, key_b}
    serve("A2", "salt-A")
    assert half.counters.hits == 1 and worker.loaded == [(key_a, key_a)]
    serve("B2", "salt-B")
    assert half.counters.hits == 2 and worker.loaded[-1] == (key_b, key_b)
    serve("plain", None)
    assert half.counters.hits == 2, "an unsalted request sees no salted entry"
    assert worker.errors == []
