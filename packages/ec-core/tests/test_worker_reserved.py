"""The writing worker's own guard of the reservation watermark: a save that
reaches a block the region has not reserved is refused and reported failed,
never written (`ec_core.region.reservation` states the invariant).

The background reservation is held at a chosen point by a gate (a wrapped
`posix_fallocate`); nothing here waits on time."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_core.region import page_reserver
from ec_core.region.files import HEADER_BYTES
from ec_core.worker_process.ranks import RankInfo
from ec_core.worker_process.transfer import (
    CompletedTransfer,
    DescriptorBatch,
    TransferDirection,
    TransferHandle,
)
from ec_core.worker_process.worker import ECCPUWorker
from ectools.configs import make_vllm_config

WIDTH = 128
BLOCK = WIDTH * 4  # fp32 rows
BLOCKS = 256
PAGE = mmap.PAGESIZE
SYNC_BLOCKS = 2 * PAGE // BLOCK  # what the constructor reserves before it returns
DEADLINE_S = 60.0


class HostWorker(ECCPUWorker):
    """Copies in host memory, synchronously."""

    def _pin_shared_region(self) -> None:
        return None

    def _submit_transfer(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: Sequence[torch.Tensor],
    ) -> TransferHandle:
        for src, dst, size in batch:
            ctypes.memmove(dst, src, size)
        return CompletedTransfer(0.0)

    def _new_device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def _shutdown_transfer_backend(self) -> None:
        return None


class PinningWorker(HostWorker):
    registers_whole_region = True


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Small chunks, and every background chunk waits until the event is set."""
    release = threading.Event()
    real = os.posix_fallocate

    def gated(fd: int, offset: int, length: int) -> None:
        if offset > 0:
            assert release.wait(DEADLINE_S), "the test never released the reservation"
        real(fd, offset, length)

    monkeypatch.setattr(page_reserver, "SYNC_RESERVE_BYTES", HEADER_BYTES + 2 * PAGE)
    monkeypatch.setattr(page_reserver, "CHUNK_BYTES", 4 * PAGE)
    monkeypatch.setattr(page_reserver.os, "posix_fallocate", gated)
    yield release
    release.set()


@pytest.fixture
def config(tiny_model_dir: str, tmp_path: Path) -> Any:
    return make_vllm_config(
        tiny_model_dir,
        role="ec_both",
        extra={"ec_cpu_bytes": BLOCKS * BLOCK, "ec_cpu_dir": str(tmp_path)},
    )


@pytest.fixture
def worker(config: Any, held: threading.Event) -> Iterator[HostWorker]:
    w = HostWorker(config, rank_info=RankInfo(rank=0, is_save_rank=True))
    yield w
    held.set()
    w.shutdown()


def _save(w: ECCPUWorker, key: str, block_ids: list[int]) -> ECCPUWorkerReport:
    source = torch.full((len(block_ids), WIDTH), 3.0)
    meta = ECCPUConnectorMetadata(
        saves={key: block_ids}, save_shapes={key: (len(block_ids), WIDTH)}
    )
    w.bind(meta)
    w.save_caches({key: source}, key, meta)
    w.get_finished()
    return w.build_connector_worker_meta()


def test_a_save_beyond_the_watermark_is_refused_until_it_moves(
    worker: HostWorker, held: threading.Event, ec_log: pytest.LogCaptureFixture
) -> None:
    assert worker.region.reserved_blocks == SYNC_BLOCKS, "the reservation is held"
    below = _save(worker, "below", list(range(SYNC_BLOCKS - 2, SYNC_BLOCKS)))
    assert below.completed_saves == ["below"] and below.failed_saves == []

    beyond = list(range(SYNC_BLOCKS - 1, SYNC_BLOCKS + 1))  # its last block is unreserved
    report = _save(worker, "beyond", beyond)
    assert report.failed_saves == [(0, 0, "beyond")] and report.completed_saves == []
    warnings = [r.getMessage() for r in ec_log.records if r.levelno == logging.WARNING]
    assert any("not saving beyond" in m and "reserved" in m for m in warnings)

    held.set()
    assert worker.region.wait_reserved(DEADLINE_S)
    blocks = worker.region.blocks.view(torch.float32)
    assert torch.all(blocks[SYNC_BLOCKS] == 0), "nothing was written"
    # The watermark moved: the same save is re-checked against the region and made.
    again = _save(worker, "beyond", beyond)
    assert again.completed_saves == ["beyond"] and again.failed_saves == []
    assert torch.all(blocks[SYNC_BLOCKS - 1 : SYNC_BLOCKS + 1] == 3.0)


@pytest.mark.parametrize("block_ids", [[BLOCKS], [-1, 0], [5, 2 * BLOCKS, 6]])
def test_a_save_outside_the_region_is_refused_without_a_crash(
    worker: HostWorker, held: threading.Event, block_ids: list[int]
) -> None:
    held.set()
    assert worker.region.wait_reserved(DEADLINE_S)
    report = _save(worker, "outside", block_ids)
    assert report.failed_saves == [(0, 0, "outside")] and report.completed_saves == []


def test_refusals_are_rate_limited(worker: HostWorker, ec_log: pytest.LogCaptureFixture) -> None:
    for i in range(4):
        report = _save(worker, f"k{i}", [SYNC_BLOCKS + i])
        assert report.failed_saves == [(0, 0, f"k{i}")]
    lines = [r.getMessage() for r in ec_log.records if "not saving" in r.getMessage()]
    assert len(lines) == 1


def test_a_worker_that_pins_the_region_has_it_reserved_in_full(
    config: Any, held: threading.Event
) -> None:
    w = PinningWorker(config, rank_info=RankInfo(rank=0, is_save_rank=True))
    try:
        assert w.region.reserved_blocks == BLOCKS, "reserved before the constructor returned"
        report = _save(w, "top", [BLOCKS - 1])
        assert report.completed_saves == ["top"]
    finally:
        w.shutdown()


class FailingBatchWorker(HostWorker):
    """Every batch fails, so each copy takes the synchronous fallback."""

    def _submit_transfer(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: Sequence[torch.Tensor],
    ) -> TransferHandle:
        raise RuntimeError("batch refused")


def test_the_fallback_copy_writes_only_the_blocks_the_watermark_check_passed(
    config: Any, held: threading.Event
) -> None:
    """Runs whose ends fit the ids pass `checked_runs` without a look at the ids
    in between: the synchronous fallback must follow those runs (what was
    checked against the watermark), never an unreserved id in between."""
    w = FailingBatchWorker(config, rank_info=RankInfo(rank=0, is_save_rank=True))
    try:
        unreserved = SYNC_BLOCKS + 3
        block_ids = [0, unreserved, 2]  # the metadata's runs say blocks 0, 1, 2
        meta = ECCPUConnectorMetadata(
            saves={"odd": block_ids}, save_shapes={"odd": (3, WIDTH)}, runs={"odd": ((0, 3),)}
        )
        w.bind(meta)
        w.save_caches({"odd": torch.full((3, WIDTH), 3.0)}, "odd", meta)
        w.get_finished()
        report = w.build_connector_worker_meta()
        assert report.completed_saves == ["odd"]
        held.set()
        assert w.region.wait_reserved(DEADLINE_S)
        blocks = w.region.blocks.view(torch.float32)
        assert torch.all(blocks[unreserved] == 0), "written above the watermark"
        assert torch.all(blocks[0:3] == 3.0), "not where the checked runs (and a batch) put it"
    finally:
        w.shutdown()
