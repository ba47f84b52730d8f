"""The CPU backend: worker copies, the one connector on a CPU host, its announcement."""

from __future__ import annotations

import collections
import gc
import mmap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.v1.outputs import ECConnectorOutput

from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_core.worker_process.ranks import RankInfo
from ec_scheduler import ECCPUScheduler
from ec_scheduler.shell.connector import ECCPUTierConnector
from ec_worker_cpu.worker import CpuECCPUWorker, LoadBufferPool, _size_class
from ectools.backend_checks import check_backend_announcement, modules_after_import
from ectools.configs import make_vllm_config
from ectools.driving import Item, StepDriver, make_request, save_meta
from ectools.faulty import FailingLoadsWorker

WIDTH = 128


@pytest.fixture
def config(tiny_model_dir: str, tmp_path: Path) -> Any:
    return make_vllm_config(
        tiny_model_dir,
        extra={"ec_cpu_bytes": "1MiB", "ec_cpu_dir": str(tmp_path)},
        widths={"image": WIDTH},
    )


@pytest.fixture
def connectors(config: Any) -> Iterator[tuple[ECCPUTierConnector, ECCPUTierConnector]]:
    worker = ECCPUTierConnector(config, ECConnectorRole.WORKER)
    scheduler = ECCPUTierConnector(config, ECConnectorRole.SCHEDULER)
    yield scheduler, worker
    worker.shutdown()
    scheduler.shutdown()


def test_worker_round_trip_is_byte_exact(config: Any) -> None:
    worker = CpuECCPUWorker(config, rank_info=RankInfo(0, True))
    try:
        data = torch.randn(5, WIDTH)
        meta = save_meta({"k": ([9, 3, 4, 5, 20], data)})
        worker.bind(meta)
        worker.save_caches({"k": data}, "k", meta)
        worker.get_finished()
        assert worker.build_connector_worker_meta().completed_saves == ["k"]
        cache: dict[str, torch.Tensor] = {}
        meta = ECCPUConnectorMetadata(loads={"k": (0, [9, 3, 4, 5, 20], (5, WIDTH))})
        worker.bind(meta)
        worker.start_load_caches(cache, meta)
        assert torch.equal(cache["k"], data)
        assert cache["k"].dtype == torch.float32 and cache["k"].device.type == "cpu"
    finally:
        worker.shutdown()


class _FirstBufferFails(CpuECCPUWorker):
    failed = False

    def _new_entry_buffer(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        if not self.failed:
            self.failed = True
            raise MemoryError("injected: cannot allocate")
        return super()._new_entry_buffer(shape, dtype)


@pytest.mark.parametrize("worker_class", [FailingLoadsWorker, _FirstBufferFails])
def test_failed_loads_fall_back_to_real_synchronous_copies(
    config: Any, worker_class: type[CpuECCPUWorker]
) -> None:
    """The real CPU backend with its load submission, or one buffer, failing."""
    worker = worker_class(config, rank_info=RankInfo(0, True))
    try:
        data = {"a": torch.randn(5, WIDTH), "b": torch.randn(2, WIDTH)}
        blocks = {"a": [9, 3, 4, 5, 20], "b": [40, 41]}
        meta = save_meta({key: (blocks[key], data[key]) for key in data})
        worker.bind(meta)
        for key in data:
            worker.save_caches(data, key, meta)
        worker.get_finished()
        assert sorted(worker.build_connector_worker_meta().completed_saves) == ["a", "b"]
        cache: dict[str, torch.Tensor] = {}
        loads = {key: (i, blocks[key], tuple(data[key].shape)) for i, key in enumerate(data)}
        meta = ECCPUConnectorMetadata(loads=loads)  # type: ignore[arg-type]
        worker.bind(meta)
        worker.start_load_caches(cache, meta)
        for key, tensor in data.items():
            assert torch.equal(cache[key], tensor)
        worker.get_finished()
        report = worker.build_connector_worker_meta()
        expected = 2 if worker_class is FailingLoadsWorker else 1
        assert report.fallbacks == [(0, "load")] * expected
        assert sorted(report.load_acks) == [(0, 0), (0, 1)]
    finally:
        worker.shutdown()


def test_roles_build_one_delegate_each(connectors: tuple[Any, Any]) -> None:
    """On a CPU host the one connector builds the CPU backend's worker."""
    scheduler, worker = connectors
    assert isinstance(scheduler.scheduler, ECCPUScheduler)
    assert isinstance(worker.worker, CpuECCPUWorker)
    with pytest.raises(RuntimeError, match="SCHEDULER role"):
        _ = scheduler.worker
    with pytest.raises(RuntimeError, match="WORKER role"):
        worker.has_cache_item("x")
    assert not worker.has_pending_push_work()


def test_save_and_reload_through_both_connector_roles(connectors: tuple[Any, Any]) -> None:
    scheduler, worker = connectors
    driver = StepDriver(scheduler)
    image = torch.randn(8, WIDTH)

    def run_worker_step(meta: ECCPUConnectorMetadata, cache: dict[str, torch.Tensor]) -> None:
        worker.bind_connector_metadata(meta)
        worker.start_load_caches(cache)
        for key in meta.saves:  # "the encoder ran" for the items to save
            cache[key] = image
            worker.save_caches(encoder_cache=cache, mm_hash=key)
        worker.get_finished(set())
        report = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        assert isinstance(report, ECCPUWorkerReport)
        scheduler.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))

    first = driver.step([make_request("r1", [Item("img")])]).meta
    run_worker_step(first, {})
    entry = scheduler.scheduler.allocator.get("img")  # type: ignore[attr-defined]
    assert entry is not None and entry.ready
    second = driver.step([make_request("r2", [Item("img")])]).meta
    assert "img" in second.loads
    cache: dict[str, torch.Tensor] = {}
    run_worker_step(second, cache)
    assert torch.equal(cache["img"], image)
    assert scheduler.scheduler.counters.loads_completed == 1  # type: ignore[attr-defined]


def test_salted_keys_round_trip_under_vllms_identifier(connectors: tuple[Any, Any]) -> None:
    """The same image from two salts: saved under two keys from the one encoder cache
    entry vLLM names by identifier (a step where vLLM calls `save_caches` once and
    the scheduler asked for both), each loaded back under that identifier for its
    own salt only; reports name the keys."""
    scheduler, worker = connectors
    half = scheduler.scheduler
    image = {"A": torch.randn(8, WIDTH), "B": torch.randn(8, WIDTH)}
    key = {salt: f"img|salt:{half.tier_keys.digest(salt)}" for salt in image}

    def run_worker_step(meta: ECCPUConnectorMetadata, cache: dict[str, torch.Tensor]) -> Any:
        worker.bind_connector_metadata(meta)
        worker.start_load_caches(cache)
        for identifier in {meta.identifiers.get(k, k) for k in meta.saves}:
            worker.save_caches(encoder_cache=cache, mm_hash=identifier)
        worker.get_finished(set())
        report = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        scheduler.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))
        return report

    for salt, encoded in image.items():  # one step per salt: vLLM's cache holds its own
        meta = StepDriver(scheduler).step([make_request(salt, [Item("img")], cache_salt=salt)]).meta
        assert list(meta.saves) == [key[salt]] and meta.identifiers == {key[salt]: "img"}
        report = run_worker_step(meta, {"img": encoded})
        assert report.completed_saves == [key[salt]]
    for salt in ("B", "A"):
        meta = (
            StepDriver(scheduler)
            .step([make_request(f"{salt}2", [Item("img")], cache_salt=salt)])
            .meta
        )
        assert list(meta.loads) == [key[salt]]
        cache: dict[str, torch.Tensor] = {}
        run_worker_step(meta, cache)
        assert list(cache) == ["img"] and torch.equal(cache["img"], image[salt])
    # Two keys of one identifier in one step's saves (vLLM encodes the item once).
    worker_half = worker.worker
    both = ECCPUConnectorMetadata(
        saves={"x|salt:1": [100], "x|salt:2": [101], "x": [102]},
        save_shapes=dict.fromkeys(("x|salt:1", "x|salt:2", "x"), (1, WIDTH)),
        identifiers={"x|salt:1": "x", "x|salt:2": "x"},
        step=99,
    )
    worker_half.bind(both)
    worker_half.save_caches({"x": torch.ones(1, WIDTH)}, "x", both)
    worker_half.get_finished()
    assert sorted(worker_half.build_connector_worker_meta().completed_saves) == [
        "x",
        "x|salt:1",
        "x|salt:2",
    ]


def test_shutdown_is_idempotent_and_removes_the_region(connectors: tuple[Any, Any]) -> None:
    scheduler, worker = connectors
    path = worker.worker.region.path
    assert path.exists()
    worker.shutdown()
    worker.shutdown()
    scheduler.shutdown()
    assert not path.exists()


def test_the_backend_announces_itself_for_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    check_backend_announcement(monkeypatch, "ec_worker_cpu", "cpu")


def test_package_import_is_light() -> None:
    heavy = ["torch", "vllm", "ec_worker_cpu.worker", "ec_core.worker_process.worker"]
    assert modules_after_import(["ec_worker_cpu", "ec_core"], heavy) == []


def test_large_entry_round_trip_through_prefaulted_buffers(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """An entry above the pre-fault threshold (fresh mapping, huge-page hint) stays exact."""
    rows = (33 << 20) // (WIDTH * 4) + 3
    config = make_vllm_config(
        tiny_model_dir, extra={"ec_cpu_bytes": "40MiB", "ec_cpu_dir": str(tmp_path)}
    )
    worker = CpuECCPUWorker(config, rank_info=RankInfo(0, True))
    try:
        data = torch.randn(rows, WIDTH)
        blocks = list(range(rows))
        meta = save_meta({"big": (blocks, data)})
        worker.bind(meta)
        worker.save_caches({"big": data}, "big", meta)
        worker.get_finished()
        assert worker.build_connector_worker_meta().completed_saves == ["big"]
        cache: dict[str, torch.Tensor] = {}
        meta = ECCPUConnectorMetadata(loads={"big": (1, blocks, (rows, WIDTH))})
        worker.bind(meta)
        worker.start_load_caches(cache, meta)
        assert torch.equal(cache["big"], data)
    finally:
        worker.shutdown()


# ------------------------------------------------------------ load buffer pool

POOLED = 256 << 10  # pooled by the pools below (a lowered `min_bytes`)


def test_pool_recycles_a_buffer_only_after_every_view_is_freed() -> None:
    pool = LoadBufferPool(idle_limit=8 << 20, min_bytes=POOLED)
    first = pool.take(POOLED, torch.bfloat16)
    rows = first.view(64, -1)
    part = rows[3:5]  # what vLLM's gather may keep
    address = first.data_ptr()
    del first, rows
    gc.collect()
    assert pool.lent == 1 and pool.idle_bytes == 0  # `part` still holds the storage
    other = pool.take(POOLED, torch.bfloat16)
    assert other.data_ptr() != address and pool.fresh == 2
    part.fill_(1.0)
    assert torch.all(part == 1.0)  # the memory is still there and still its own
    del part
    gc.collect()
    assert pool.lent == 1 and pool.idle_bytes > 0
    again = pool.take(POOLED, torch.bfloat16)
    assert again.data_ptr() == address and pool.fresh == 2  # recycled
    assert again.numel() == POOLED // 2 and again.is_contiguous()
    del other, again


def test_a_lent_tensor_keeps_its_memory_when_the_pool_is_gone() -> None:
    """The tensor vLLM holds owns its memory through its storage alone: dropping the
    pool (a worker shut down and collected while the encoder cache lives on) frees
    nothing under it."""
    pool = LoadBufferPool(idle_limit=8 << 20, min_bytes=POOLED)
    lent = pool.take(POOLED, torch.uint8)
    lent.fill_(7)
    pool.close()
    del pool
    gc.collect()
    scratch = [torch.full((POOLED,), 1, dtype=torch.uint8) for _ in range(4)]  # reuse freed memory
    assert torch.all(lent == 7)
    lent.fill_(9)
    assert all(torch.all(s == 1) for s in scratch), "the lent memory is shared with another tensor"


def test_pool_keeps_at_most_its_idle_limit() -> None:
    pool = LoadBufferPool(idle_limit=3 * POOLED, min_bytes=POOLED)
    buffers = [pool.take(POOLED, torch.uint8) for _ in range(6)]
    del buffers
    gc.collect()
    assert pool.lent == 0 and pool.idle_bytes == 3 * POOLED
    pool.idle_limit = 0
    pool.take(POOLED, torch.uint8)  # settles: nothing may stay idle now
    assert pool.idle_bytes == 0


def test_a_load_finds_host_memory_the_pool_held_idle(
    config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host memory runs out while the pool keeps idle buffers of another size: they are
    freed and the load gets its buffer, instead of failing twice (batched path and
    fallback both ask the pool) and taking the engine down with an ECCPULoadError."""
    from ec_worker_cpu import worker as cpu_worker

    worker = _SmallPooledWorker(config, rank_info=RankInfo(0, True))
    try:
        rows = 2 * POOLED // (WIDTH * 4)  # another size class than the idle buffers
        data, blocks = _saved(worker, rows)
        idle = [worker.load_pool.take(POOLED, torch.uint8) for _ in range(3)]
        del idle
        gc.collect()
        assert worker.load_pool.idle_bytes > 0

        class _Exhausted(cpu_worker._Buffer):
            def __init__(self, size: int) -> None:
                if worker.load_pool.idle_bytes:  # the memory idle buffers hold is missing
                    raise RuntimeError("injected: DefaultCPUAllocator: not enough memory")
                super().__init__(size)

        monkeypatch.setattr(cpu_worker, "_Buffer", _Exhausted)
        cache: dict[str, torch.Tensor] = {}
        load = ECCPUConnectorMetadata(loads={"k": (0, blocks, (rows, WIDTH))})
        worker.bind(load)
        worker.start_load_caches(cache, load)
        assert torch.equal(cache["k"], data)
        assert worker.load_pool.idle_bytes == 0
    finally:
        worker.shutdown()


def test_pool_takes_buffers_freed_on_other_threads_and_after_close() -> None:
    pool = LoadBufferPool(idle_limit=8 << 20, min_bytes=POOLED)
    held = [pool.take(POOLED, torch.uint8) for _ in range(4)]

    def free() -> None:
        held.clear()
        gc.collect()

    thread = threading.Thread(target=free)
    thread.start()
    thread.join()
    assert pool.lent == 0 and pool.idle_bytes == 4 * _size_class(POOLED)
    late = pool.take(POOLED, torch.uint8)
    pool.close()
    assert pool.idle_bytes == 0
    del late
    gc.collect()
    assert pool.idle_bytes == 0 and pool.lent == 0  # nothing is kept after close
    assert pool.take(POOLED, torch.uint8).numel() == POOLED  # plain allocations then


def test_a_buffer_freed_on_another_thread_while_the_pool_closes_is_not_kept() -> None:
    """`close` runs on one thread between another thread's free of a lent entry and the
    queueing of its buffer (forced here: the queue's append first lets `close` run to
    the end); the buffer is still freed, not filed as idle in the closed pool."""
    pool = LoadBufferPool(idle_limit=8 << 20, min_bytes=POOLED)
    held = [pool.take(POOLED, torch.uint8)]

    class CloseFirst(collections.deque[Any]):
        def append(self, buffer: Any) -> None:
            closer = threading.Thread(target=pool.close)
            closer.start()
            closer.join()
            super().append(buffer)

    pool._returned = CloseFirst()
    freer = threading.Thread(target=held.clear)
    freer.start()
    freer.join()
    assert pool.lent == 0
    assert pool.idle_bytes == 0 and not pool._free.get(_size_class(POOLED))
    assert not pool._returned, "nothing is kept after close"


def test_size_classes_waste_at_most_an_eighth() -> None:
    for nbytes in (1, 4096, 65537, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 12345, 64 << 20):
        size = _size_class(nbytes)
        assert size >= nbytes and size % mmap.PAGESIZE == 0
        assert size <= max(nbytes * 9 // 8, 16 * mmap.PAGESIZE) + mmap.PAGESIZE


def _saved(worker: CpuECCPUWorker, rows: int) -> tuple[torch.Tensor, list[int]]:
    """One step saving a random `rows x WIDTH` entry "k" from block 0: its data and blocks."""
    data = torch.randn(rows, WIDTH)
    blocks = list(range(rows * WIDTH * 4 // worker.block_size))
    meta = save_meta({"k": (blocks, data)})
    worker.bind(meta)
    worker.save_caches({"k": data}, "k", meta)
    worker.get_finished()
    worker.build_connector_worker_meta()
    return data, blocks


class _SmallPooledWorker(CpuECCPUWorker):
    load_pool_min_bytes = POOLED


def test_loads_recycle_the_buffers_of_entries_vllm_freed(config: Any) -> None:
    """Through the worker: the second load of a freed entry reuses its buffer, while an
    entry vLLM still holds is never written by a later load."""
    rows = POOLED // (WIDTH * 4)
    worker = _SmallPooledWorker(config, rank_info=RankInfo(0, True))
    try:
        data, blocks = _saved(worker, rows)
        load = ECCPUConnectorMetadata(loads={"k": (0, blocks, (rows, WIDTH))})
        held: dict[str, torch.Tensor] = {}
        worker.bind(load)
        worker.start_load_caches(held, load)
        worker.build_connector_worker_meta()
        kept = held["k"]
        kept_address = kept.data_ptr()
        for _ in range(3):
            cache: dict[str, torch.Tensor] = {}
            worker.bind(load)
            worker.start_load_caches(cache, load)
            worker.build_connector_worker_meta()
            assert cache["k"].data_ptr() != kept_address
            assert torch.equal(cache["k"], data) and torch.equal(kept, data)
            assert cache["k"].shape == (rows, WIDTH) and cache["k"].dtype == torch.float32
            del cache
            gc.collect()
        assert worker.load_pool.fresh == 2  # one for `kept`, one recycled three times
    finally:
        worker.shutdown()


def test_a_step_of_several_entries_reports_each_once_with_its_figures(config: Any) -> None:
    """Saves of one run and of several runs, a shape sent as a list, and a source of
    the wrong shape in one step; then their loads: the bytes come back exact, each
    copy is acknowledged once with its step, the copied bytes are in the figures,
    nothing stays in flight, and only the wrong source is reported failed."""
    worker = CpuECCPUWorker(config, rank_info=RankInfo(0, True))
    row = WIDTH * 4
    try:
        a, b, bad = torch.randn(4, WIDTH), torch.randn(3, WIDTH), torch.randn(2, WIDTH)
        blocks = {"a": [10, 11, 12, 13], "b": [30, 5, 6], "bad": [40, 41, 42]}
        assert worker.block_size == row
        meta = ECCPUConnectorMetadata(
            saves=blocks,
            save_shapes={"a": (4, WIDTH), "b": [3, WIDTH], "bad": (3, WIDTH)},  # type: ignore[dict-item]
            step=7,
        )
        cache = {"a": a, "b": b, "bad": bad}
        worker.bind(meta)
        for key in cache:
            worker.save_caches(cache, key, meta)
        worker.get_finished()
        report = worker.build_connector_worker_meta()
        assert report.completed_saves == ["a", "b"]
        assert report.save_acks == [(0, 7, "a"), (0, 7, "b")]
        assert report.failed_saves == [(0, 7, "bad")]
        assert report.stats["bytes_saved"] == 7 * row and report.stats["save_copy_seconds"] >= 0
        assert report.progress == [(0, 7, 7)] and worker.num_inflight == 0

        loads = ECCPUConnectorMetadata(
            loads={"b": (2, blocks["b"], (3, WIDTH)), "a": (1, blocks["a"], (4, WIDTH))}, step=8
        )
        loaded: dict[str, torch.Tensor] = {}
        worker.bind(loads)
        worker.start_load_caches(loaded, loads)
        worker.get_finished()
        report = worker.build_connector_worker_meta()
        assert torch.equal(loaded["a"], a) and torch.equal(loaded["b"], b)
        assert loaded["a"].data_ptr() != loaded["b"].data_ptr()
        assert sorted(report.completed_loads) == [1, 2]
        assert sorted(report.load_acks) == [(0, 1), (0, 2)]
        assert report.stats["bytes_loaded"] == 7 * row and report.completed_saves == []
        assert report.progress == [(0, 8, 8)] and worker.num_inflight == 0

        worker.bind(ECCPUConnectorMetadata(step=9))
        worker.get_finished()
        report = worker.build_connector_worker_meta()
        assert report.completed_saves == [] and report.completed_loads == []
        assert report.save_acks == [] and report.load_acks == [] and report.stats == {}
        assert report.progress == [(0, 9, 9)]
    finally:
        worker.shutdown()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_pool_builds_entries_in_their_shape_and_recycles_them_only_once_free(
    dtype: torch.dtype,
) -> None:
    """`take` with a shape: the entry's own shape and dtype (numpy lacks bfloat16: it is
    built as int16 and viewed), over memory of its own, back in the pool only after
    every view of it is gone, exactly as a 1-D take viewed in that shape."""
    pool = LoadBufferPool(idle_limit=8 << 20, min_bytes=POOLED)
    cols = 256
    rows = POOLED // (cols * dtype.itemsize)
    entry = pool.take(POOLED, dtype, (rows, cols))
    assert entry.shape == (rows, cols) and entry.dtype == dtype and entry.is_contiguous()
    assert entry.untyped_storage().nbytes() >= POOLED
    values = torch.arange(rows * cols).reshape(rows, cols).to(dtype)
    entry.copy_(values)
    address = entry.data_ptr()
    part = entry[2:4]
    del entry
    gc.collect()
    assert pool.lent == 1 and pool.idle_bytes == 0  # `part` still holds the storage
    assert torch.equal(part, values[2:4])
    del part
    gc.collect()
    assert pool.lent == 0 and pool.idle_bytes == _size_class(POOLED)
    flat = pool.take(POOLED, dtype)
    assert flat.data_ptr() == address and flat.shape == (rows * cols,)  # recycled
    assert pool.fresh == 1
    small = pool.take(POOLED // 2, dtype, (rows // 2, cols))  # below min_bytes: plain
    assert small.shape == (rows // 2, cols) and pool.fresh == 1


def test_pool_serves_a_dtype_numpy_cannot_stand_in_for_without_losing_a_buffer() -> None:
    """A dtype with no numpy type of its size (complex128, 16 bytes) gets a plain tensor;
    the idle buffer stays in the pool for the next load that can use it."""
    pool = LoadBufferPool(idle_limit=8 << 20, min_bytes=POOLED)
    first = pool.take(POOLED, torch.float32)
    del first
    gc.collect()
    assert pool.idle_bytes == _size_class(POOLED)
    odd = pool.take(POOLED, torch.complex128, (POOLED // 16,))
    assert odd.shape == (POOLED // 16,) and odd.dtype == torch.complex128
    assert pool.idle_bytes == _size_class(POOLED) and pool.lent == 0
    again = pool.take(POOLED, torch.float32)
    assert pool.fresh == 1 and pool.lent == 1 and again.numel() == POOLED // 4


def test_a_one_entry_bf16_step_through_the_pool_is_byte_exact(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """The benchmark's step: one bfloat16 entry of one run, saved and loaded again and
    again through pooled buffers; bytes exact, one buffer recycled throughout."""
    rows, width = 64, 4096  # 512 KiB, pooled by `_SmallPooledWorker`
    config = make_vllm_config(
        tiny_model_dir,
        dtype="bfloat16",
        extra={"ec_cpu_bytes": "2MiB", "ec_cpu_dir": str(tmp_path)},
        widths={"image": width},
    )
    worker = _SmallPooledWorker(config, rank_info=RankInfo(0, True))
    try:
        data = torch.randn(rows, width).to(torch.bfloat16)
        blocks = list(range(rows * width * 2 // worker.block_size))
        meta = ECCPUConnectorMetadata(
            saves={"k": blocks}, save_shapes={"k": (rows, width)}, runs={"k": ((0, len(blocks)),)}
        )
        worker.bind(meta)
        worker.save_caches({"k": data}, "k", meta)
        worker.get_finished()
        assert worker.build_connector_worker_meta().save_acks == [(0, 0, "k")]
        load = ECCPUConnectorMetadata(
            loads={"k": (5, blocks, (rows, width))}, runs={"k": ((0, len(blocks)),)}
        )
        cache: dict[str, torch.Tensor] = {}
        for _ in range(3):
            cache.clear()
            worker.bind(load)
            worker.start_load_caches(cache, load)
            worker.get_finished()
            report = worker.build_connector_worker_meta()
            assert torch.equal(cache["k"], data) and cache["k"].dtype == torch.bfloat16
            assert report.load_acks == [(0, 5)] and report.fallbacks == []
        assert worker.load_pool.fresh == 1
    finally:
        worker.shutdown()
