"""The scheduler follows the region's background reservation: it allocates only
blocks the creator has reserved, picks up new ones at the start of a step, and
works with a smaller cache when the reservation stops early."""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from vllm.config import VllmConfig

from ec_core.layout import region_layout
from ec_core.region import page_reserver
from ec_core.region.files import HEADER_BYTES
from ec_core.region.opening import open_region
from ec_core.settings import ECCPUSettings
from ec_scheduler import ECCPUScheduler
from ec_scheduler import connections as connections_mod
from ectools.driving import (
    Item,
    SimulatedRanks,
    StepDriver,
    connector_output,
    make_request,
    scheduler_output,
)

BLOCK = 128 * 4  # see conftest: one fp32 row of the tiny model per block
BLOCKS = 256
ROWS = 8  # an item's blocks
DEADLINE_S = 60.0


@pytest.fixture
def follow(
    role_configs: dict[str, VllmConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> ECCPUScheduler:
    monkeypatch.setattr(page_reserver, "SYNC_RESERVE_BYTES", HEADER_BYTES + 16 * BLOCK)
    monkeypatch.setattr(page_reserver, "CHUNK_BYTES", 64 * BLOCK)
    monkeypatch.setattr(connections_mod, "_RESERVATION_POLL_S", 0.0)
    config = role_configs["ec_both"]
    settings = ECCPUSettings.from_extra_config(
        {"ec_cpu_bytes": BLOCKS * BLOCK, "ec_cpu_dir": str(tmp_path)}, block_size_bytes=BLOCK
    )
    layout = replace(region_layout(config), num_blocks=BLOCKS, settings=settings)
    return ECCPUScheduler(config, layout=layout, follow_reservation=True)


def _saved_blocks(scheduler: ECCPUScheduler, key: str) -> list[int]:
    meta = StepDriver(scheduler).step([make_request(key, [Item(key, embeds=ROWS)])]).meta
    return meta.saves.get(key, [])


def test_nothing_is_allocated_before_the_region_exists(follow: ECCPUScheduler) -> None:
    assert follow.allocator.num_reserved_blocks == 0
    assert _saved_blocks(follow, "a") == []
    assert follow.counters.saves_skipped_full == 1


def test_blocks_arrive_as_the_reservation_advances(
    follow: ECCPUScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = os.posix_fallocate

    def gated(fd: int, offset: int, length: int) -> None:
        if offset > 0:
            assert release.wait(DEADLINE_S)
        real(fd, offset, length)

    monkeypatch.setattr(page_reserver.os, "posix_fallocate", gated)
    region = open_region(follow.layout, background_reserve=True)
    try:
        follow.build_connector_meta(scheduler_output())  # a step starts: it looks
        assert follow.allocator.num_reserved_blocks == 16
        first = [_saved_blocks(follow, f"k{i}") for i in range(3)]
        assert first[0] == list(range(8)) and first[1] == list(range(8, 16))
        assert first[2] == [], "the region's third item is not reserved yet"
        release.set()
        assert region.wait_reserved(DEADLINE_S) and region.reserved_blocks == BLOCKS
        follow.build_connector_meta(scheduler_output())
        assert follow.allocator.num_reserved_blocks == BLOCKS
        assert follow._connections.reservation is None, "a final watermark is not looked at again"
        assert _saved_blocks(follow, "k3") == list(range(16, 24))
        follow.allocator.check()
    finally:
        release.set()
        region.cleanup()


def test_a_reservation_stopped_early_leaves_a_working_smaller_cache(
    follow: ECCPUScheduler, monkeypatch: pytest.MonkeyPatch, ec_log: pytest.LogCaptureFixture
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        if offset > 0:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(page_reserver.os, "posix_fallocate", full)
    region = open_region(follow.layout, background_reserve=True)
    try:
        assert region.wait_reserved(DEADLINE_S) and region.reserved_blocks == 16
        follow.build_connector_meta(scheduler_output())
        assert follow.allocator.num_reserved_blocks == 16
        assert follow._connections.reservation is None
        ranks = SimulatedRanks()
        for i in range(6):  # more than fits: saves evict and go on, nothing raises
            key = f"s{i}"
            meta = StepDriver(follow).step([make_request(key, [Item(key, embeds=ROWS)])]).meta
            assert meta.saves[key] and max(meta.saves[key]) < 16
            follow.update_connector_output(connector_output(ranks.report(meta)))
        follow.allocator.check()
    finally:
        region.cleanup()
    assert any("only 16 of 256 region blocks" in r.getMessage() for r in ec_log.records)
    assert follow.stat_totals()["region_used_blocks"] <= 16
