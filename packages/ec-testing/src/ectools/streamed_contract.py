"""The contract every streamed (CUDA/NPU-style) backend worker must meet.

A backend's test module defines a `make` fixture returning `(worker, runtime)`
— its worker class over a `FakeDeviceRuntime` — and star-imports this module:
pytest then runs every `test_*` below against that backend. One suite, so the
backends are held to the same behaviour without copying tests between them.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_core.worker_process.entries import ECCPULoadError
from ec_core.worker_process.ranks import RankInfo
from ec_core.worker_process.streamed import StreamedECCPUWorker
from ec_core.worker_process.transfer import TransferDirection
from ectools.configs import make_vllm_config
from ectools.driving import save_meta
from ectools.fake_device import FakeDeviceRuntime

WIDTH = 128
"""Embedding width of the tiny BLIP-2 config the `make` fixtures use (fp32 rows)."""
Factory = Callable[..., tuple[StreamedECCPUWorker, FakeDeviceRuntime]]


def streamed_factory(
    worker_class: type[StreamedECCPUWorker], model_dir: str, region_dir: Path, **config: Any
) -> Iterator[Factory]:
    """Body of a backend's `make` fixture: `yield from streamed_factory(...)`.

    Every worker made shares one engine config (so ranks share one region)
    and is shut down when the test ends.
    """
    vllm_config = make_vllm_config(
        model_dir, extra={"ec_cpu_bytes": 64 * WIDTH * 4, "ec_cpu_dir": str(region_dir)}, **config
    )
    made: list[StreamedECCPUWorker] = []

    def factory(rank: int = 0, **options: Any) -> tuple[StreamedECCPUWorker, FakeDeviceRuntime]:
        runtime = FakeDeviceRuntime(**options)
        worker = worker_class(vllm_config, runtime=runtime, rank_info=RankInfo(rank, rank == 0))
        made.append(worker)
        return worker, runtime

    yield factory
    for worker in made:
        worker.shutdown()


__all__ = [
    "test_a_failed_load_allocation_falls_back_for_that_entry",
    "test_a_failed_load_batch_is_drained_then_copied_synchronously",
    "test_a_load_that_fails_on_the_device_stops_the_engine_once",
    "test_a_save_that_fails_on_the_device_is_reported_failed_once",
    "test_async_round_trip_reports_only_after_landing",
    "test_descriptor_limit_splits_batches",
    "test_each_rank_registers_its_own_mapping",
    "test_failed_registration_warns_once_and_copies_still_work",
    "test_failed_submission_returns_everything_and_copies_synchronously",
    "test_region_is_cleaned_up_when_the_backend_fails_to_shut_down",
    "test_registration_covers_the_block_area_page_rounded",
    "test_shutdown_order_and_idempotence",
    "test_stream_ordering_and_allocator_protection",
    "test_without_a_batched_api_each_run_is_one_async_copy",
]


def _save(
    worker: StreamedECCPUWorker, saves: dict[str, tuple[list[int], torch.Tensor]]
) -> ECCPUWorkerReport:
    meta = save_meta(saves)
    worker.bind(meta)
    cache = {k: t for k, (_, t) in saves.items()}
    for key in saves:
        worker.save_caches(cache, key, meta)
    worker.get_finished()
    return worker.build_connector_worker_meta()


def _load(
    worker: StreamedECCPUWorker, loads: dict[str, tuple[int, list[int], tuple[int, int]]]
) -> tuple[dict[str, torch.Tensor], ECCPUWorkerReport]:
    cache: dict[str, torch.Tensor] = {}
    meta = ECCPUConnectorMetadata(loads=loads)
    worker.bind(meta)
    worker.start_load_caches(cache, meta)
    worker.get_finished()
    return cache, worker.build_connector_worker_meta()


def _idle_step(worker: StreamedECCPUWorker) -> ECCPUWorkerReport:
    worker.bind(ECCPUConnectorMetadata())
    worker.get_finished()
    return worker.build_connector_worker_meta()


def test_async_round_trip_reports_only_after_landing(make: Factory) -> None:
    worker, runtime = make()
    a, b = torch.randn(4, WIDTH), torch.randn(3, WIDTH)
    report = _save(worker, {"a": ([0, 1, 2, 3], a), "b": ([10, 11, 20], b)})
    assert report.completed_saves == [], "nothing landed yet"
    assert runtime.batch_calls == [(TransferDirection.DEVICE_TO_HOST, 3)]
    runtime.complete()
    assert _idle_step(worker).completed_saves == ["a", "b"]
    cache, report = _load(
        worker, {"a": (7, [0, 1, 2, 3], (4, WIDTH)), "b": (8, [10, 11, 20], (3, WIDTH))}
    )
    assert report.load_acks == []
    runtime.complete()
    assert sorted(_idle_step(worker).load_acks) == [(0, 7), (0, 8)]
    assert torch.equal(cache["a"], a) and torch.equal(cache["b"], b)


def test_stream_ordering_and_allocator_protection(make: Factory) -> None:
    worker, runtime = make(synchronous=True)
    src = torch.randn(2, WIDTH)
    _save(worker, {"s": ([0, 1], src)})
    cache, _ = _load(worker, {"s": (1, [0, 1], (2, WIDTH))})
    events = [e for e in runtime.log if e[0] in ("wait", "batch_copy", "record_stream")]
    side = next(e[1] for e in events if e[0] == "batch_copy")
    # Save: side waits for compute, protects the source, copies on the side stream.
    assert events[0] == ("wait", side, "compute")
    assert events[1] == ("record_stream", side, src.data_ptr())
    assert events[2] == ("batch_copy", side, "save", 1)
    # Load: the same pooled stream; compute waits for it after the copy.
    assert events[3] == ("wait", side, "compute")
    assert events[4] == ("record_stream", side, cache["s"].data_ptr())
    assert events[5] == ("batch_copy", side, "load", 1)
    assert events[6] == ("wait", "compute", side)
    assert len([e for e in runtime.log if e[0] == "new_stream"]) == 1, "the stream is pooled"
    assert runtime.events_created == 2, "the events are pooled"


def test_descriptor_limit_splits_batches(make: Factory) -> None:
    worker, runtime = make(synchronous=True, max_batch_descriptors=2)
    data = torch.randn(5, WIDTH)
    report = _save(worker, {"x": ([1, 3, 5, 7, 9], data)})  # five runs of one block
    assert report.completed_saves == ["x"]
    assert runtime.batch_calls == [(TransferDirection.DEVICE_TO_HOST, n) for n in (2, 2, 1)]
    cache, _ = _load(worker, {"x": (0, [1, 3, 5, 7, 9], (5, WIDTH))})
    assert torch.equal(cache["x"], data)


def test_registration_covers_the_block_area_page_rounded(make: Factory) -> None:
    worker, runtime = make()
    [(address, nbytes)] = runtime.registered.items()
    assert address == worker.region.base_address
    assert nbytes % mmap.PAGESIZE == 0 and nbytes >= worker.region.nbytes
    assert worker.is_pinned


def test_each_rank_registers_its_own_mapping(make: Factory) -> None:
    first, rt0 = make(rank=0)
    second, rt1 = make(rank=1)
    assert first.region.path == second.region.path
    assert list(rt0.registered) == [first.region.base_address]
    assert list(rt1.registered) == [second.region.base_address]
    assert first.region.base_address != second.region.base_address


def test_failed_registration_warns_once_and_copies_still_work(
    make: Factory, ec_log: pytest.LogCaptureFixture
) -> None:
    worker, runtime = make(synchronous=True, fail_register="cudaErrorHostMemoryAlreadyRegistered")
    assert not worker.is_pinned
    warnings = [r.getMessage() for r in ec_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "cudaErrorHostMemoryAlreadyRegistered" in warnings[0] and "pageable" in warnings[0]
    data = torch.randn(3, WIDTH)
    assert _save(worker, {"p": ([4, 5, 9], data)}).completed_saves == ["p"]
    cache, _ = _load(worker, {"p": (0, [4, 5, 9], (3, WIDTH))})
    assert torch.equal(cache["p"], data)
    assert runtime.batch_calls == [], "unpinned memory takes the per-copy path"
    assert runtime.single_copies == 4  # two runs each way
    worker.shutdown()
    assert not any(e[0] == "unregister_host" for e in runtime.log)


def test_without_a_batched_api_each_run_is_one_async_copy(make: Factory) -> None:
    worker, runtime = make(synchronous=True, batch=False)
    data = torch.randn(6, WIDTH)
    _save(worker, {"f": ([0, 1, 2, 30, 31, 40], data)})
    assert runtime.single_copies == 3 and runtime.batch_calls == []
    cache, _ = _load(worker, {"f": (0, [0, 1, 2, 30, 31, 40], (6, WIDTH))})
    assert torch.equal(cache["f"], data)


def test_failed_submission_returns_everything_and_copies_synchronously(make: Factory) -> None:
    worker, runtime = make(synchronous=True, max_batch_descriptors=1, fail_batch_call=2)
    data = torch.randn(2, WIDTH)
    report = _save(worker, {"s": ([0, 2], data)})
    assert report.save_acks == [(0, 0, "s")] and report.fallbacks == [(0, "save")]
    assert ("synchronize_stream", "side1") in runtime.log, "partial work is drained"
    assert len(worker._stream_pool) == 1 and len(worker._event_pool) == 2
    good = torch.randn(2, WIDTH)
    assert _save(worker, {"t": ([5, 6], good)}).completed_saves == ["t"]
    assert len([e for e in runtime.log if e[0] == "new_stream"]) == 1, "no stream leaked"
    cache, report = _load(worker, {"t": (3, [5, 6], (2, WIDTH)), "s": (4, [0, 2], (2, WIDTH))})
    assert torch.equal(cache["t"], good) and torch.equal(cache["s"], data)
    assert report.fallbacks == []


def test_a_failed_load_batch_is_drained_then_copied_synchronously(make: Factory) -> None:
    """The batch's second chunk fails: its first chunk is drained, every entry still loads."""
    worker, runtime = make(max_batch_descriptors=1)
    a, b = torch.randn(2, WIDTH), torch.randn(3, WIDTH)
    _save(worker, {"a": ([0, 1], a), "b": ([10, 20, 30], b)})
    runtime.complete()
    assert sorted(_idle_step(worker).completed_saves) == ["a", "b"]
    runtime.fail_batch_call = len(runtime.batch_calls) + 2
    cache, report = _load(
        worker, {"a": (1, [0, 1], (2, WIDTH)), "b": (2, [10, 20, 30], (3, WIDTH))}
    )
    assert torch.equal(cache["a"], a) and torch.equal(cache["b"], b), "landed before return"
    assert report.fallbacks == [(0, "load"), (0, "load")]
    assert sorted(report.load_acks) == [(0, 1), (0, 2)]
    assert any(e[0] == "synchronize_stream" for e in runtime.log), "the side stream was drained"
    assert len(worker._stream_pool) == 1, "stream back in the pool"


def test_a_failed_load_allocation_falls_back_for_that_entry(make: Factory) -> None:
    worker, runtime = make(synchronous=True)
    a, b = torch.randn(2, WIDTH), torch.randn(2, WIDTH)
    _save(worker, {"a": ([0, 1], a), "b": ([4, 5], b)})
    runtime.fail_device_empty = runtime.device_allocations + 1  # a's batched buffer
    cache, report = _load(worker, {"a": (1, [0, 1], (2, WIDTH)), "b": (2, [4, 5], (2, WIDTH))})
    assert torch.equal(cache["a"], a) and torch.equal(cache["b"], b)
    assert report.fallbacks == [(0, "load")]
    assert runtime.batch_calls[-1] == (TransferDirection.HOST_TO_DEVICE, 1), "b went batched"


def test_shutdown_order_and_idempotence(make: Factory) -> None:
    worker, runtime = make()
    _save(worker, {"s": ([0, 1], torch.randn(2, WIDTH))})  # still in flight
    path = worker.region.path
    worker.shutdown()
    order = [e[0] for e in runtime.log if e[0] in ("synchronize_device", "unregister_host")]
    assert order == ["synchronize_device", "unregister_host"]
    assert runtime.registered == {}
    assert not path.exists()
    worker.shutdown()
    worker._shutdown_transfer_backend()
    assert [e[0] for e in runtime.log].count("unregister_host") == 1


@pytest.mark.parametrize("failure", ["fail_unregister", "fail_synchronize_device"])
def test_region_is_cleaned_up_when_the_backend_fails_to_shut_down(
    make: Factory, failure: str
) -> None:
    worker, runtime = make(**{failure: "boom"} if failure == "fail_unregister" else {failure: True})
    path = worker.region.path
    worker.shutdown()
    assert not path.exists()
    # The failing call was made: the fault was injected, not skipped.
    failing = "unregister_host" if failure == "fail_unregister" else "synchronize_device"
    assert any(entry[0] == failing for entry in runtime.log), runtime.log


def _save_in_step(
    worker: StreamedECCPUWorker, step: int, key: str, blocks: list[int], data: torch.Tensor
) -> ECCPUWorkerReport:
    meta = save_meta({key: (blocks, data)}, step=step)
    worker.bind(meta)
    worker.save_caches({key: data}, key, meta)
    worker.get_finished()
    return worker.build_connector_worker_meta()


def test_a_save_that_fails_on_the_device_is_reported_failed_once(
    make: Factory, ec_log: pytest.LogCaptureFixture
) -> None:
    """A save batch accepted at submission whose copy then fails on the device (its
    event raises) is reported failed in its step, with a warning, instead of raising
    out of the engine's step; the batch beside it is acknowledged exactly once and
    the failed stream is never handed to a later batch."""
    worker, runtime = make(fail_async_batch=2)
    a, b, c = torch.randn(2, WIDTH), torch.randn(2, WIDTH), torch.randn(2, WIDTH)
    assert _save_in_step(worker, 1, "a", [0, 1], a).save_acks == []
    assert _save_in_step(worker, 2, "b", [4, 5], b).save_acks == []
    runtime.complete()
    report = _idle_step(worker)
    assert report.save_acks == [(0, 1, "a")]
    assert report.failed_saves == [(0, 2, "b")]
    assert report.progress == [(0, 2, 2)]
    assert any("injected asynchronous copy failure" in r.getMessage() for r in ec_log.records)
    again = _idle_step(worker)
    assert again.save_acks == [] and again.failed_saves == [] and worker.num_inflight == 0
    _save_in_step(worker, 3, "c", [8, 9], c)
    runtime.complete()
    assert _idle_step(worker).save_acks == [(0, 3, "c")], "the stream in error was not reused"


def test_a_load_that_fails_on_the_device_stops_the_engine_once(make: Factory) -> None:
    """A load whose copy fails on the device after submission cannot be taken back
    (the step gathered from its buffer): the report raises ECCPULoadError naming the
    transfer, once; batches that landed beside it are still reported, once."""
    worker, runtime = make(synchronous=True)
    a, b = torch.randn(2, WIDTH), torch.randn(2, WIDTH)
    _save(worker, {"a": ([0, 1], a), "b": ([4, 5], b)})
    runtime.synchronous = False
    runtime.fail_async_batch = len(runtime.batch_calls) + 2
    for step, key, tid, blocks in ((2, "a", 7, [0, 1]), (3, "b", 8, [4, 5])):
        meta = ECCPUConnectorMetadata(loads={key: (tid, blocks, (2, WIDTH))}, step=step)
        worker.bind(meta)
        worker.start_load_caches({}, meta)
        worker.get_finished()
        assert worker.build_connector_worker_meta().load_acks == []
    runtime.complete()
    with pytest.raises(ECCPULoadError, match=r"transfer\(s\) \[8\]"):
        worker.build_connector_worker_meta()
    report = worker.build_connector_worker_meta()
    assert report.load_acks == [(0, 7)] and worker.num_inflight == 0
    assert worker.build_connector_worker_meta().load_acks == []
