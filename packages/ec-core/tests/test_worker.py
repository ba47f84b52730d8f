"""The common ECCPUWorker, through an instrumented host-memory backend."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_core.region.mapping import ECSharedRegion
from ec_core.worker_process import worker as worker_module
from ec_core.worker_process.entries import ECCPULoadError
from ec_core.worker_process.ranks import RankInfo
from ec_core.worker_process.transfer import (
    DescriptorBatch,
    TransferDirection,
    TransferHandle,
    block_runs,
    checked_runs,
)
from ec_core.worker_process.worker import ECCPUWorker
from ectools.configs import make_vllm_config
from ectools.peer_secrets import secret_keys

WIDTH = 128
BLOCK = WIDTH * 4  # fp32 rows


class Handle:
    def __init__(self, backend: HostBackend, batch: DescriptorBatch) -> None:
        self.backend = backend
        self.batch = batch
        self.done = not backend.deferred
        self.released = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.backend.events.append("synchronize")
        self.complete()

    def complete(self) -> None:
        if not self.done:
            for src, dst, size in self.batch:
                ctypes.memmove(dst, src, size)
            self.done = True

    def release(self) -> None:
        assert self.done, "released before completion"
        self.released = True

    def elapsed_seconds(self) -> float | None:
        return 0.25 if self.done else None


class HostBackend(ECCPUWorker):
    """Copies in host memory; can defer completion and fail on demand."""

    deferred = False

    def __init__(self, *args: Any, fail_pin: bool = False, **kwargs: Any) -> None:
        self.fail_pin = fail_pin
        self.events: list[str] = []
        self.submits: list[tuple[TransferDirection, int]] = []
        self.handles: list[Handle] = []
        self.fail_next_submit = False
        self.fail_allocations = 0
        """Fail this many device buffer allocations from now on."""
        self.fail_copy_now = False
        self.copies_now = 0
        self.fail_shutdown = False
        super().__init__(*args, **kwargs)

    def _pin_shared_region(self) -> None:
        self.events.append("pin")
        if self.fail_pin:
            raise RuntimeError("pinning refused")

    def _submit_transfer(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: Sequence[torch.Tensor],
    ) -> TransferHandle:
        if self.fail_next_submit:
            self.fail_next_submit = False
            raise RuntimeError("injected submit failure")
        self.submits.append((direction, len(batch)))
        handle = Handle(self, batch)
        if handle.done:
            for src, dst, size in batch:
                ctypes.memmove(dst, src, size)
        self.handles.append(handle)
        return handle

    def _new_device_buffer(self, nbytes: int) -> torch.Tensor:
        if self.fail_allocations:
            self.fail_allocations -= 1
            raise RuntimeError("injected out of device memory")
        return torch.empty(nbytes, dtype=torch.uint8)

    def _copy_now(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.fail_copy_now:
            raise RuntimeError("injected synchronous copy failure")
        self.copies_now += 1
        super()._copy_now(dst, src)

    def _shutdown_transfer_backend(self) -> None:
        self.events.append("backend-shutdown")
        if self.fail_shutdown:
            raise RuntimeError("backend refused to shut down")


@pytest.fixture
def config_factory(tiny_model_dir: str, tmp_path: Path) -> Any:
    def make(role: str = "ec_both") -> Any:
        return make_vllm_config(
            tiny_model_dir,
            role=role,
            extra={"ec_cpu_bytes": 256 * BLOCK, "ec_cpu_dir": str(tmp_path)},
        )

    return make


@pytest.fixture
def worker(config_factory: Any) -> Iterator[HostBackend]:
    w = HostBackend(config_factory(), rank_info=RankInfo(rank=0, is_save_rank=True))
    yield w
    w.shutdown()


def _step_save(
    w: ECCPUWorker,
    saves: dict[str, list[int]],
    cache: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, int]] | None = None,
) -> ECCPUWorkerReport:
    """One step saving `cache[key]` into `saves[key]`, allocated for `shapes[key]`
    (default: the tensor's own shape)."""
    meta = ECCPUConnectorMetadata(
        saves=saves,
        save_shapes=shapes
        if shapes is not None
        else {key: (int(cache[key].shape[0]), int(cache[key].shape[1])) for key in saves},
    )
    w.bind(meta)
    w.start_load_caches(cache, meta)
    for key in saves:
        w.save_caches(cache, key, meta)
    w.get_finished()
    return w.build_connector_worker_meta()


def _step_load(
    w: ECCPUWorker, loads: dict[str, tuple[int, list[int], tuple[int, int]]]
) -> tuple[dict[str, torch.Tensor], ECCPUWorkerReport]:
    cache: dict[str, torch.Tensor] = {}
    meta = ECCPUConnectorMetadata(loads=loads)
    w.bind(meta)
    w.start_load_caches(cache, meta)
    w.get_finished()
    return cache, w.build_connector_worker_meta()


def test_block_runs() -> None:
    assert block_runs([]) == []
    assert block_runs([5]) == [(5, 1)]
    assert block_runs([3, 4, 5, 6]) == [(3, 4)]
    assert block_runs([9, 2, 3, 4, 10, 11]) == [(9, 1), (2, 3), (10, 2)]
    assert block_runs([7, 6, 5]) == [(7, 1), (6, 1), (5, 1)]


def test_checked_runs_take_the_metadatas_runs_only_when_they_fit_the_ids() -> None:
    ids = [4, 5, 6, 10, 11]
    sent = ((4, 3), (10, 2))
    assert checked_runs(ids, sent) == [(4, 3), (10, 2)]
    assert checked_runs(ids, None) == block_runs(ids)
    # Runs that do not describe the ids are not trusted: the ids decide.
    for wrong in (
        ((4, 5),),  # the ends do not sit where the run says
        ((4, 3), (10, 1)),  # too few ids
        ((4, 3), (10, 3)),  # more ids than the list holds
        ((4, 3), (10, 2), (20, 1)),
        ((4, 0), (4, 3), (10, 2)),  # an empty run
        ((5, 3), (10, 2)),
        (),
    ):
        assert checked_runs(ids, wrong) == [(4, 3), (10, 2)], wrong
    assert checked_runs([], ()) == []
    assert checked_runs([], ((0, 1),)) == []
    assert block_runs([5, 9, 7, 8]) == [(5, 1), (9, 1), (7, 2)]
    assert block_runs([0, 1, 2, 9, 4, 5]) == [(0, 3), (9, 1), (4, 2)]
    assert block_runs((1, 2, 3)) == [(1, 3)]


def _runs_one_by_one(ids: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for block in ids:
        if runs and block == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


@settings(deadline=None)  # a stall of a loaded machine is no failure
@given(st.lists(st.integers(min_value=0, max_value=40), max_size=60))
def test_block_runs_of_any_list_match_a_scan(ids: list[int]) -> None:
    assert block_runs(ids) == _runs_one_by_one(ids)


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 50)), min_size=1, max_size=12))
def test_block_runs_of_rising_runs_are_those_runs(gaps_and_lengths: list[tuple[int, int]]) -> None:
    # What the allocator hands out: ascending runs with gaps (a zero gap merges two).
    ids: list[int] = []
    position = 0
    for gap, length in gaps_and_lengths:
        position += gap
        ids.extend(range(position, position + length))
        position += length
    assert block_runs(ids) == _runs_one_by_one(ids)


def test_descriptor_batch_split() -> None:
    batch = DescriptorBatch()
    for i in range(10):
        batch.add(i, 100 + i, 1 + i)
    chunks = batch.split(4)
    assert [len(c) for c in chunks] == [4, 4, 2]
    assert sum(c.nbytes for c in chunks) == batch.nbytes
    src, dst, sizes = chunks[1].as_tensors()
    assert src.tolist() == [4, 5, 6, 7] and dst.dtype == torch.int64
    assert sizes.tolist() == [5, 6, 7, 8]


def test_save_then_load_round_trips_bytes(worker: HostBackend) -> None:
    a = torch.randn(8, WIDTH)
    b = torch.randn(3, WIDTH)
    # a: one run; b: scattered over three runs in a scrambled order.
    saves = {"a": list(range(10, 18)), "b": [40, 41, 7, 99]}
    b_blocks = [40, 41, 7]
    report = _step_save(worker, {"a": saves["a"], "b": b_blocks}, {"a": a, "b": b})
    assert report.completed_saves == ["a", "b"]
    assert report.stats == {"bytes_saved": (8 + 3) * BLOCK, "save_copy_seconds": 0.25}
    assert worker.submits == [(TransferDirection.DEVICE_TO_HOST, 1 + 2)]
    cache, report = _step_load(
        worker, {"a": (1, saves["a"], (8, WIDTH)), "b": (2, b_blocks, (3, WIDTH))}
    )
    assert report.completed_loads == [1, 2] or report.completed_loads == [2, 1]
    assert sorted(report.load_acks) == [(0, 1), (0, 2)]
    assert report.stats == {"bytes_loaded": (8 + 3) * BLOCK, "load_copy_seconds": 0.25}
    assert worker.submits[-1] == (TransferDirection.HOST_TO_DEVICE, 3)
    assert torch.equal(cache["a"], a) and torch.equal(cache["b"], b)
    assert cache["a"].shape == (8, WIDTH) and cache["a"].dtype == torch.float32


def test_runs_sent_with_the_metadata_become_the_descriptors(worker: HostBackend) -> None:
    """The scheduler sends each entry's runs; the worker copies by them, and runs
    that do not fit the ids (here: a lie about the first one) are not trusted."""
    a = torch.randn(6, WIDTH)
    a_blocks = [20, 21, 22, 50, 51, 52]
    meta = ECCPUConnectorMetadata(
        saves={"a": a_blocks}, save_shapes={"a": (6, WIDTH)}, runs={"a": ((20, 3), (50, 3))}
    )
    worker.bind(meta)
    worker.save_caches({"a": a}, "a", meta)
    worker.get_finished()
    assert worker.build_connector_worker_meta().completed_saves == ["a"]
    assert worker.submits[-1] == (TransferDirection.DEVICE_TO_HOST, 2)
    for runs in (((20, 3), (50, 3)), ((21, 3), (50, 3))):  # the second does not fit
        cache: dict[str, torch.Tensor] = {}
        meta = ECCPUConnectorMetadata(loads={"a": (7, a_blocks, (6, WIDTH))}, runs={"a": runs})
        worker.bind(meta)
        worker.start_load_caches(cache, meta)
        worker.get_finished()
        assert worker.build_connector_worker_meta().completed_loads == [7]
        assert worker.submits[-1] == (TransferDirection.HOST_TO_DEVICE, 2)
        assert torch.equal(cache["a"], a)


def test_loaded_entries_own_their_memory(worker: HostBackend) -> None:
    src = {k: torch.randn(2, WIDTH) for k in "xy"}
    _step_save(worker, {"x": [0, 1], "y": [2, 3]}, src)
    cache, _ = _step_load(worker, {"x": (0, [0, 1], (2, WIDTH)), "y": (1, [2, 3], (2, WIDTH))})
    storages = {cache[k].untyped_storage().data_ptr() for k in "xy"}
    assert len(storages) == 2, "each loaded entry must have a buffer of its own"
    region = worker.region.blocks
    region_span = (region.data_ptr(), region.data_ptr() + region.numel())
    for key in "xy":
        assert not region_span[0] <= cache[key].data_ptr() < region_span[1]
        assert cache[key].untyped_storage().nbytes() == 2 * WIDTH * 4


def test_partial_last_block_preserves_the_rest_of_the_region(worker: HostBackend) -> None:
    worker.region.blocks[5:7].fill_(77)
    # 1.5 blocks worth of data: rows of half width would not fit a block exactly,
    # so use a bf16-sized payload through a (3, 64) fp32 tensor: 768 bytes.
    src = torch.randn(3, 64)
    meta = ECCPUConnectorMetadata(saves={"p": [5, 6]}, save_shapes={"p": (3, 64)})
    worker.bind(meta)
    worker.save_caches({"p": src}, "p", meta)
    worker.get_finished()
    assert worker.build_connector_worker_meta().completed_saves == ["p"]
    tail = worker.region.blocks[6, 768 - BLOCK :]
    assert torch.all(tail == 77), "bytes past the entry must not be written"
    cache, _ = _step_load(worker, {"p": (0, [5, 6], (3, 64))})
    assert torch.equal(cache["p"], src)


@pytest.mark.parametrize(
    ("tensor", "shape", "needle"),
    [
        (torch.randn(9, WIDTH), (8, WIDTH), "shape"),  # larger than its allocation
        (torch.randn(2, WIDTH), (8, WIDTH), "shape"),  # far smaller
        (torch.randn(4, 2 * WIDTH), (8, WIDTH), "shape"),  # same bytes, other rows x width
        (torch.randn(8 * WIDTH), (8, WIDTH), "shape"),  # same bytes, 1-D
        (torch.randn(8, WIDTH).half(), (8, WIDTH), "dtype"),
        (torch.randn(8, WIDTH), None, "no shape"),
    ],
)
def test_bad_saves_are_skipped_with_a_warning(
    worker: HostBackend,
    ec_log: pytest.LogCaptureFixture,
    tensor: torch.Tensor,
    shape: tuple[int, int] | None,
    needle: str,
) -> None:
    worker.region.blocks[:8].fill_(5)
    meta = ECCPUConnectorMetadata(
        saves={"bad": list(range(8))}, save_shapes={} if shape is None else {"bad": shape}
    )
    worker.bind(meta)
    worker.save_caches({"bad": tensor}, "bad", meta)
    worker.get_finished()
    report = worker.build_connector_worker_meta()
    assert report.failed_saves == [(0, 0, "bad")] and report.completed_saves == []
    assert torch.all(worker.region.blocks[:8] == 5), "nothing may be written"
    assert any(needle in r.getMessage() for r in ec_log.records if r.levelno == logging.WARNING)


def test_rejected_save_warnings_are_rate_limited(
    worker: HostBackend, ec_log: pytest.LogCaptureFixture
) -> None:
    for step in range(5):
        report = _step_save(
            worker,
            {f"bad{step}": [0, 1]},
            {f"bad{step}": torch.randn(3, WIDTH)},
            {f"bad{step}": (2, WIDTH)},
        )
        assert report.failed_saves == [(0, 0, f"bad{step}")]
    lines = [r.getMessage() for r in ec_log.records if "not saving" in r.getMessage()]
    assert len(lines) == 1 and "bad0" in lines[0]


class _NoMemoryForACopy(torch.Tensor):
    """A strided encoder output whose contiguous copy finds no device memory."""

    def contiguous(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")


def test_a_save_whose_contiguous_copy_fails_is_skipped_not_raised(
    worker: HostBackend, ec_log: pytest.LogCaptureFixture
) -> None:
    """Out of device memory for the copy of one output must not stop the engine's step:
    the save is skipped and reported failed (the entry is encoded again later)."""
    worker.region.blocks[:2].fill_(5)
    strided = torch.randn(WIDTH, 2).t().as_subclass(_NoMemoryForACopy)
    report = _step_save(worker, {"s": [0, 1]}, {"s": strided})
    assert report.failed_saves == [(0, 0, "s")] and report.completed_saves == []
    assert torch.all(worker.region.blocks[:2] == 5), "nothing may be written"
    assert any("contiguous copy" in r.getMessage() for r in ec_log.records)


def test_a_save_never_produced_is_reported_failed(worker: HostBackend) -> None:
    meta = ECCPUConnectorMetadata(saves={"ghost": [0]}, save_shapes={"ghost": (1, WIDTH)}, step=3)
    worker.bind(meta)
    worker.get_finished()
    report = worker.build_connector_worker_meta()
    assert report.failed_saves == [(0, 3, "ghost")]
    assert worker.submits == []


def test_a_step_that_skipped_get_finished_still_reports_its_saves_never_produced(
    worker: HostBackend,
) -> None:
    """vLLM skips `get_finished` when `start_load_caches` raises: the next step's
    `bind` ends the previous one, and its saves never produced are reported failed
    (their blocks come back at once, not after the report timeout)."""
    first = ECCPUConnectorMetadata(saves={"lost": [0]}, save_shapes={"lost": (1, WIDTH)}, step=3)
    worker.bind(first)  # the step fails before any save_caches and get_finished
    worker.bind(ECCPUConnectorMetadata(step=4))
    worker.get_finished()
    report = worker.build_connector_worker_meta()
    assert report.failed_saves == [(0, 3, "lost")]


def test_non_save_rank_loads_but_never_saves(config_factory: Any) -> None:
    config = config_factory()  # one engine: both ranks share its config and region
    rank0 = HostBackend(config, rank_info=RankInfo(rank=0, is_save_rank=True))
    rank1 = HostBackend(config, rank_info=RankInfo(rank=1, is_save_rank=False))
    try:
        data = torch.randn(4, WIDTH)
        report1 = _step_save(rank1, {"k": [0, 1, 2, 3]}, {"k": data})
        assert report1.completed_saves == [] and report1.failed_saves == []
        assert report1.progress == [(1, 0, 0)]
        _step_save(rank0, {"k": [0, 1, 2, 3]}, {"k": data})
        cache, report = _step_load(rank1, {"k": (9, [0, 1, 2, 3], (4, WIDTH))})
        assert report.load_acks == [(1, 9)]
        assert torch.equal(cache["k"], data)
    finally:
        rank1.shutdown()
        rank0.shutdown()


def test_every_step_reports_its_rank_and_progress(worker: HostBackend) -> None:
    for step in (1, 2, 5):
        meta = ECCPUConnectorMetadata(step=step)
        worker.bind(meta)
        worker.start_load_caches({}, meta)
        worker.get_finished()
        report = worker.build_connector_worker_meta()
        assert isinstance(report, ECCPUWorkerReport)
        assert report.progress == [(0, step, step)]
        assert report.completed_saves == report.completed_loads == []
    assert worker.submits == []


def test_a_failed_load_submission_falls_back_to_a_synchronous_copy(
    worker: HostBackend, ec_log: pytest.LogCaptureFixture
) -> None:
    """The batched path raises: the load is still published, byte for byte, and counted."""
    good = torch.randn(3, WIDTH)
    other = torch.randn(2, WIDTH)
    _step_save(worker, {"t": [2, 3, 9], "u": [20, 21]}, {"t": good, "u": other})
    worker.fail_next_submit = True
    cache, report = _step_load(
        worker, {"t": (4, [2, 3, 9], (3, WIDTH)), "u": (5, [20, 21], (2, WIDTH))}
    )
    assert torch.equal(cache["t"], good) and torch.equal(cache["u"], other)
    assert sorted(report.load_acks) == [(0, 4), (0, 5)]
    assert report.fallbacks == [(0, "load"), (0, "load")]
    assert report.stats["bytes_loaded"] == 5 * BLOCK
    assert worker.copies_now == 3, "one synchronous copy per run of blocks"
    assert any("synchronously" in r.getMessage() for r in ec_log.records)
    cache, report = _step_load(worker, {"t": (6, [2, 3, 9], (3, WIDTH))})
    assert torch.equal(cache["t"], good) and report.fallbacks == [], "batched again"
    assert worker.num_inflight == 0


def test_a_failed_load_buffer_falls_back_for_that_entry_only(worker: HostBackend) -> None:
    a, b = torch.randn(2, WIDTH), torch.randn(2, WIDTH)
    _step_save(worker, {"a": [0, 1], "b": [4, 5]}, {"a": a, "b": b})
    worker.fail_allocations = 1  # the first entry's buffer (a, lower blocks)
    cache, report = _step_load(worker, {"a": (1, [0, 1], (2, WIDTH)), "b": (2, [4, 5], (2, WIDTH))})
    assert torch.equal(cache["a"], a) and torch.equal(cache["b"], b)
    assert report.fallbacks == [(0, "load")]
    assert worker.submits[-1] == (TransferDirection.HOST_TO_DEVICE, 1), "b went batched"
    assert sorted(report.load_acks) == [(0, 1), (0, 2)]


def test_a_load_no_path_can_make_names_entry_backend_and_causes(worker: HostBackend) -> None:
    _step_save(worker, {"img-7": [0, 1]}, {"img-7": torch.randn(2, WIDTH)})
    worker.fail_next_submit = True
    worker.fail_copy_now = True
    meta = ECCPUConnectorMetadata(loads={"img-7": (3, [0, 1], (2, WIDTH))})
    worker.bind(meta)
    with pytest.raises(ECCPULoadError) as info:
        worker.start_load_caches({}, meta)
    message = str(info.value)
    assert "'img-7'" in message and "HostBackend" in message and "rank 0" in message
    assert "injected submit failure" in message and "injected synchronous copy failure" in message
    worker.fail_allocations = 2  # the batched buffer and the fallback's
    with pytest.raises(ECCPULoadError, match="injected out of device memory"):
        worker.start_load_caches({}, meta)


def test_a_load_outside_the_region_is_refused_before_any_copy(worker: HostBackend) -> None:
    meta = ECCPUConnectorMetadata(loads={"x": (1, [254, 255, 256], (3, WIDTH))})
    worker.bind(meta)
    with pytest.raises(ECCPULoadError, match="outside the region"):
        worker.start_load_caches({}, meta)
    meta = ECCPUConnectorMetadata(loads={"y": (2, [0], (3, WIDTH))})  # too few blocks
    with pytest.raises(ECCPULoadError, match="too few"):
        worker.start_load_caches({}, meta)
    assert worker.submits == []


def test_a_failed_save_submission_falls_back_to_a_synchronous_copy(worker: HostBackend) -> None:
    data = torch.randn(2, WIDTH)
    worker.fail_next_submit = True
    report = _step_save(worker, {"s": [0, 1]}, {"s": data})
    assert report.completed_saves == ["s"] and report.save_acks == [(0, 0, "s")]
    assert report.fallbacks == [(0, "save")] and report.failed_saves == []
    cache, _ = _step_load(worker, {"s": (1, [0, 1], (2, WIDTH))})
    assert torch.equal(cache["s"], data)


def test_a_save_no_path_can_make_is_reported_failed(
    worker: HostBackend, ec_log: pytest.LogCaptureFixture
) -> None:
    worker.region.blocks[:2].fill_(9)
    worker.fail_next_submit = True
    worker.fail_copy_now = True
    report = _step_save(worker, {"s": [0, 1]}, {"s": torch.randn(2, WIDTH)})
    assert report.failed_saves == [(0, 0, "s")] and report.completed_saves == []
    assert report.fallbacks == []
    assert any("injected synchronous copy failure" in r.getMessage() for r in ec_log.records)
    worker.fail_copy_now = False
    good = torch.randn(2, WIDTH)
    assert _step_save(worker, {"t": [2, 3]}, {"t": good}).completed_saves == ["t"]


def test_completion_is_reported_only_when_the_copy_landed(config_factory: Any) -> None:
    class Deferred(HostBackend):
        deferred = True

    w = Deferred(config_factory(), rank_info=RankInfo(0, True))
    try:
        data = torch.randn(2, WIDTH)
        meta = ECCPUConnectorMetadata(saves={"d": [0, 1]}, save_shapes={"d": (2, WIDTH)}, step=4)
        w.bind(meta)
        w.save_caches({"d": data}, "d", meta)
        w.get_finished()
        report = w.build_connector_worker_meta()
        assert report.completed_saves == []
        assert report.progress == [(0, 4, 3)], "step 4's save may still write"
        assert w.num_inflight == 1
        for step in (5, 6):  # later steps do not settle past the copy in flight
            w.bind(ECCPUConnectorMetadata(step=step))
            w.get_finished()
            assert w.build_connector_worker_meta().progress == [(0, step, 3)]
        w.handles[0].complete()
        w.bind(ECCPUConnectorMetadata(step=7))
        w.get_finished()
        report = w.build_connector_worker_meta()
        assert report.completed_saves == ["d"] and report.save_acks == [(0, 4, "d")]
        assert report.progress == [(0, 7, 7)]
        assert w.handles[0].released
        assert w.num_inflight == 0
    finally:
        w.shutdown()


def test_shutdown_waits_then_releases_backend_then_region(config_factory: Any) -> None:
    class Deferred(HostBackend):
        deferred = True

    w = Deferred(config_factory(), rank_info=RankInfo(0, True))
    _step_save(w, {"d": [0, 1]}, {"d": torch.randn(2, WIDTH)})
    path = w.region.path
    w.shutdown()
    assert w.events == ["pin", "synchronize", "backend-shutdown"]
    assert w.handles[0].released
    assert not path.exists()
    w.shutdown()
    assert w.events.count("backend-shutdown") == 1


def test_shutdown_removes_the_region_file_before_it_waits_for_anything(
    config_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM SIGKILLs a worker still shutting down 5 s after it asked the engine to
    stop: a slow copy or backend release must not keep the file alive until then.
    The mapping stays until the end, so the copy in flight still lands."""

    class Slow(HostBackend):
        deferred = True

        def _shutdown_transfer_backend(self) -> None:
            seen.append(("backend", self.region.path.exists()))
            super()._shutdown_transfer_backend()

    seen: list[tuple[str, bool]] = []
    w = Slow(config_factory(), rank_info=RankInfo(0, True))
    data = torch.randn(2, WIDTH)
    _step_save(w, {"d": [0, 1]}, {"d": data})
    handle = w.handles[0]
    drain = handle.synchronize

    def synchronize() -> None:
        seen.append(("drain", w.region.path.exists()))
        drain()
        seen.append(("landed", torch.equal(w.region.blocks[:2].view(torch.float32), data)))

    monkeypatch.setattr(handle, "synchronize", synchronize)
    w.shutdown()
    assert seen == [("drain", False), ("landed", True), ("backend", False)]
    assert w.region.closed


def test_region_is_cleaned_up_even_if_the_backend_fails(config_factory: Any) -> None:
    w = HostBackend(config_factory(), rank_info=RankInfo(0, True))
    w.fail_shutdown = True
    path = w.region.path
    w.shutdown()
    assert not path.exists()


def test_pin_failure_at_construction_leaves_no_region(config_factory: Any, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="pinning refused"):
        HostBackend(config_factory(), rank_info=RankInfo(0, True), fail_pin=True)
    assert list(tmp_path.glob("ec_cpu_tier_*")) == []


def test_consumer_only_worker_ignores_saves(config_factory: Any) -> None:
    w = HostBackend(config_factory("ec_consumer"), rank_info=RankInfo(0, True))
    try:
        report = _step_save(w, {"k": [0]}, {"k": torch.randn(1, WIDTH)})
        assert report.completed_saves == [] and report.failed_saves == []
        assert w.submits == []
    finally:
        w.shutdown()


# ------------------------------------------- one-entry steps (the fast paths)


@pytest.mark.parametrize("blocks", [[10, 11, 12], [30, 5, 6]], ids=["one-run", "two-runs"])
def test_a_one_entry_step_copies_and_reports_as_a_step_of_several(
    worker: HostBackend, blocks: list[int]
) -> None:
    """A step of one save (one load) takes the path without lists; the same entry in a
    step with another gives the same bytes, descriptors and report entries."""
    data = torch.randn(3, WIDTH)
    other = torch.randn(2, WIDTH)
    alone = _step_save(worker, {"k": blocks}, {"k": data})
    alone_submit = worker.submits[-1]
    paired = _step_save(worker, {"k": blocks, "o": [60, 61]}, {"k": data, "o": other})
    assert alone.completed_saves == ["k"] and alone.save_acks == [(0, 0, "k")]
    assert paired.completed_saves == ["k", "o"] and paired.save_acks[0] == (0, 0, "k")
    assert alone.stats == {"bytes_saved": 3 * BLOCK, "save_copy_seconds": 0.25}
    assert alone.progress == paired.progress == [(0, 0, 0)]
    assert alone_submit == (TransferDirection.DEVICE_TO_HOST, len(block_runs(blocks)))

    load = (7, blocks, (3, WIDTH))
    one, one_report = _step_load(worker, {"k": load})
    assert worker.submits[-1] == (TransferDirection.HOST_TO_DEVICE, len(block_runs(blocks)))
    two, two_report = _step_load(worker, {"k": load, "o": (8, [60, 61], (2, WIDTH))})
    assert torch.equal(one["k"], data) and torch.equal(two["k"], data)
    assert one["k"].shape == two["k"].shape and one["k"].dtype == two["k"].dtype
    assert one_report.completed_loads == [7] and one_report.load_acks == [(0, 7)]
    assert sorted(two_report.load_acks) == [(0, 7), (0, 8)]
    assert one_report.stats == {"bytes_loaded": 3 * BLOCK, "load_copy_seconds": 0.25}
    assert one_report.fallbacks == two_report.fallbacks == []
    assert worker.num_inflight == 0


@pytest.mark.parametrize("fault", ["submit", "buffer", "both"])
def test_a_one_entry_load_falls_back_as_a_step_of_several(worker: HostBackend, fault: str) -> None:
    """The one-entry load path falls back like the general one: a failed submission or
    buffer is copied synchronously and counted; with no path left it raises."""
    data = torch.randn(2, WIDTH)
    _step_save(worker, {"k": [0, 1]}, {"k": data})
    worker.fail_next_submit = fault in ("submit", "both")
    worker.fail_allocations = 1 if fault == "buffer" else 0
    worker.fail_copy_now = fault == "both"
    submits = len(worker.submits)
    if fault == "both":
        with pytest.raises(ECCPULoadError, match="injected synchronous copy failure"):
            _step_load(worker, {"k": (3, [0, 1], (2, WIDTH))})
        return
    cache, report = _step_load(worker, {"k": (3, [0, 1], (2, WIDTH))})
    assert torch.equal(cache["k"], data)
    assert report.fallbacks == [(0, "load")] and report.load_acks == [(0, 3)]
    assert report.stats["bytes_loaded"] == 2 * BLOCK
    assert len(worker.submits) == submits, "nothing was submitted a second time"


def test_a_one_entry_save_that_fails_to_submit_falls_back(worker: HostBackend) -> None:
    data = torch.randn(2, WIDTH)
    worker.fail_next_submit = True
    report = _step_save(worker, {"s": [4, 5]}, {"s": data})
    assert report.save_acks == [(0, 0, "s")] and report.fallbacks == [(0, "save")]
    cache, _ = _step_load(worker, {"s": (1, [4, 5], (2, WIDTH))})
    assert torch.equal(cache["s"], data)


class _Sender:
    """Stands in for the report side channel's sending end (ReportSender)."""

    made: ClassVar[list[_Sender]] = []
    fail = False

    def __init__(self, address: str, secret: bytes) -> None:
        if _Sender.fail:
            raise OSError(24, "Too many open files")
        self.closed = False
        _Sender.made.append(self)

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("failing", ["side channel", "pin"])
def test_a_failed_construction_leaves_no_region_and_no_side_channel(
    tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """An encode-only producer with peers opens the report side channel. When that
    failed, the constructor raised with the region mapped and its file left behind;
    when pinning failed after it, the channel's socket stayed open."""
    monkeypatch.setattr(worker_module, "ReportSender", _Sender)
    monkeypatch.setattr(_Sender, "made", [])
    monkeypatch.setattr(_Sender, "fail", failing == "side channel")
    config = make_vllm_config(
        tiny_model_dir,
        role="ec_producer",
        extra={
            "ec_cpu_bytes": 256 * BLOCK,
            "ec_cpu_dir": str(tmp_path),
            "ec_peer_listen": "127.0.0.1:5999",
            **secret_keys(tmp_path / "secret", "a-test-secret"),
        },
    )
    with pytest.raises((OSError, RuntimeError)):
        HostBackend(config, rank_info=RankInfo(0, True), fail_pin=failing == "pin")
    assert list(tmp_path.glob("ec_cpu_tier_*")) == []
    assert all(sender.closed for sender in _Sender.made)
    assert len(_Sender.made) == (1 if failing == "pin" else 0)


def test_a_failed_read_of_the_watermark_leaves_no_region(
    tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first thing the constructor reads of a region it opened is the watermark
    (a joiner reads the creator's record from the file); that read failing left the
    region mapped and its file behind."""

    def unreadable(region: object) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ECSharedRegion, "reserved_blocks", property(unreadable))
    config = make_vllm_config(
        tiny_model_dir,
        role="ec_both",
        extra={"ec_cpu_bytes": 256 * BLOCK, "ec_cpu_dir": str(tmp_path)},
    )
    with pytest.raises(OSError, match="Input/output error"):
        HostBackend(config, rank_info=RankInfo(0, True))
    assert list(tmp_path.glob("ec_cpu_tier_*")) == []
