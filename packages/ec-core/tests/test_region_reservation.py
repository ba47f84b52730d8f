"""The background reservation: the watermark, a directory that fills up partway,
shutdown while it runs, and the scheduler-side reader (`RegionReservation`).

Nothing here depends on machine speed: the reservation thread is held at a
chosen chunk by a gate (a wrapped `posix_fallocate`) and the tests wait on
events with generous deadlines, never on sleeps."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ec_core.region import mapping as region_mod
from ec_core.region import page_reserver
from ec_core.region.files import HEADER_BYTES
from ec_core.region.mapping import ECSharedRegion
from ec_core.region.reservation import (
    RECORD_OFFSET,
    RegionReservation,
    Reservation,
    ReservationState,
    pack_record,
    read_record,
    unpack_record,
)
from ectools.tmpfs import mounted_tmpfs

PAGE = mmap.PAGESIZE
BLOCK = PAGE  # so every offset below is page aligned, whatever the page size
SYNC = HEADER_BYTES + 4 * BLOCK  # the front reserved before the constructor returns
CHUNK = 8 * BLOCK
BLOCKS = 64  # 4 blocks up front, then 8 chunks of 8 blocks (the last one short by the header)
DEADLINE_S = 60.0


@pytest.fixture
def region_dir(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir()
    return path


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(page_reserver, "SYNC_RESERVE_BYTES", SYNC)
    monkeypatch.setattr(page_reserver, "CHUNK_BYTES", CHUNK)


class Gate:
    """Wraps `posix_fallocate`: a call at or beyond `hold_at` waits for `release`.

    `fail_at` makes calls at or beyond it fail with ENOSPC instead (after the gate).
    """

    def __init__(self, hold_at: int | None = None, fail_at: int | None = None) -> None:
        self.hold_at = hold_at
        self.fail_at = fail_at
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[tuple[int, int]] = []
        self._real: Callable[[int, int, int], None] = os.posix_fallocate

    def __call__(self, fd: int, offset: int, length: int) -> None:
        self.calls.append((offset, length))
        if self.hold_at is not None and offset >= self.hold_at:
            self.entered.set()
            assert self.release.wait(DEADLINE_S), "the test never released the gate"
        if self.fail_at is not None and offset >= self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._real(fd, offset, length)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    the_gate = Gate()
    monkeypatch.setattr(region_mod.os, "posix_fallocate", the_gate)
    yield the_gate
    the_gate.release.set()


def _watcher(region: ECSharedRegion) -> RegionReservation:
    return RegionReservation(
        region.path,
        region.num_blocks,
        region.block_size_bytes,
        engine_id=region.engine_id,
        owner="",
    )


def test_the_constructor_returns_with_the_front_reserved_and_the_rest_follows(
    region_dir: Path, gate: Gate
) -> None:
    gate.hold_at = SYNC
    with ECSharedRegion(
        "bg", BLOCKS, BLOCK, directory=region_dir, background_reserve=True
    ) as region:
        assert gate.entered.wait(DEADLINE_S)
        assert region.reserved_blocks == 4, "only the synchronous front is reserved yet"
        assert gate.calls == [(0, SYNC), (SYNC, CHUNK)]
        watcher = _watcher(region)
        assert watcher.poll() == 4 and not watcher.final
        with ECSharedRegion(
            "bg", BLOCKS, BLOCK, directory=region_dir, background_reserve=True
        ) as joiner:
            assert not joiner.is_creator
            assert joiner.reserved_blocks == 4
            assert not joiner.wait_reserved(timeout_s=0)
            gate.release.set()
            assert region.wait_reserved(DEADLINE_S)
            assert region.reserved_blocks == BLOCKS
            assert region.reservation_error is None
            assert joiner.wait_reserved(DEADLINE_S) and joiner.reserved_blocks == BLOCKS
            joiner.blocks.fill_(5)  # every block is writable now
            assert torch.all(region.blocks == 5)
        assert watcher.poll() == BLOCKS and watcher.final
    # Chunks cover the file exactly, from the front, once each.
    spans = sorted(gate.calls)
    assert spans[0] == (0, SYNC)
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))
    assert spans[-1][0] + spans[-1][1] == HEADER_BYTES + BLOCKS * BLOCK


def test_a_small_region_is_reserved_before_the_constructor_returns(
    region_dir: Path, gate: Gate
) -> None:
    with ECSharedRegion("small", 4, BLOCK, directory=region_dir, background_reserve=True) as region:
        assert region.reserved_blocks == 4
        assert region.wait_reserved(timeout_s=0)
        assert region._reserver is None, "no thread for a region reserved up front"
        assert gate.calls == [(0, HEADER_BYTES + 4 * BLOCK)]
        assert _watcher(region).poll() == 4


def test_a_full_directory_partway_leaves_a_smaller_working_region(
    region_dir: Path, gate: Gate, ec_log: pytest.LogCaptureFixture
) -> None:
    stop_at = SYNC + 3 * CHUNK
    gate.fail_at = stop_at
    with ECSharedRegion(
        "partial", BLOCKS, BLOCK, directory=region_dir, background_reserve=True
    ) as region:
        assert region.wait_reserved(DEADLINE_S)
        expected = (stop_at - HEADER_BYTES) // BLOCK
        assert region.reserved_blocks == expected < BLOCKS
        error = region.reservation_error
        assert error is not None and error.errno == errno.ENOSPC
        assert not any(offset > stop_at for offset, _ in gate.calls), "it went on after ENOSPC"
        region.blocks[:expected].fill_(9)  # the reserved part works
        assert int(region.blocks[expected - 1, -1]) == 9
        watcher = _watcher(region)
        assert watcher.poll() == expected and watcher.final
        assert watcher.poll() == expected  # final: no more system calls, same answer
    messages = [r.getMessage() for r in ec_log.records if r.levelname == "WARNING"]
    assert any(f"only {expected} of {BLOCKS} blocks" in m and "is full" in m for m in messages)
    assert any(f"only {expected} of {BLOCKS} region blocks" in m for m in messages)


def test_an_unexpected_error_in_the_background_stops_it_without_raising(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch, ec_log: pytest.LogCaptureFixture
) -> None:
    def eio(address: int, length: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(page_reserver, "_populate_write_address", eio)
    with ECSharedRegion(
        "eio", BLOCKS, BLOCK, directory=region_dir, background_reserve=True
    ) as region:
        assert region.wait_reserved(DEADLINE_S)
        assert region.reserved_blocks == 4
        region.blocks[:4].fill_(1)
    assert any("I/O error" in r.getMessage() for r in ec_log.records)


class PrefaultGate:
    """Wraps `_populate_write_address` (the background pre-fault, which touches
    the mapping): a call at or beyond file offset `hold_at` waits for `release`."""

    def __init__(self, hold_at: int) -> None:
        self.hold_at = hold_at
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self.base = 0  # the mapping's address (set by the test)
        self._real: Callable[[int, int], None] = page_reserver._populate_write_address

    def __call__(self, address: int, length: int) -> None:
        self.calls += 1
        if address - self.base >= self.hold_at:
            self.entered.set()
            assert self.release.wait(DEADLINE_S), "the test never released the gate"
        self._real(address, length)


@pytest.fixture
def prefault_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[PrefaultGate]:
    the_gate = PrefaultGate(hold_at=SYNC + CHUNK)  # the second background chunk waits
    monkeypatch.setattr(page_reserver, "_populate_write_address", the_gate)
    # cleanup() waits for the held chunk until the test releases it, however slow the
    # machine (a test of the give-up path sets its own, shorter, wait).
    monkeypatch.setattr(page_reserver, "STOP_TIMEOUT_S", DEADLINE_S)
    yield the_gate
    the_gate.release.set()


def _mapping_open(region: ECSharedRegion) -> bool:
    return region._mmap is not None and not region._mmap.closed


def test_cleanup_during_the_reservation_stops_the_thread(
    region_dir: Path, prefault_gate: PrefaultGate, ec_log: pytest.LogCaptureFixture
) -> None:
    region = ECSharedRegion(
        "shutdown", BLOCKS, BLOCK, directory=region_dir, background_reserve=True
    )
    prefault_gate.base = region.base_address - HEADER_BYTES
    assert prefault_gate.entered.wait(DEADLINE_S)
    reserver = region._reserver
    assert reserver is not None and reserver.is_alive()
    watcher = _watcher(region)
    closer = threading.Thread(target=region.cleanup)
    closer.start()
    # cleanup() asks the thread to stop before it waits for it, and the pages
    # the thread is pre-faulting stay mapped while it waits.
    assert region._stop.wait(DEADLINE_S)
    assert _mapping_open(region)
    calls_before = prefault_gate.calls
    prefault_gate.release.set()
    closer.join(DEADLINE_S)
    assert not closer.is_alive() and not reserver.is_alive()
    assert prefault_gate.calls == calls_before, "no chunk started after the stop"
    assert region.reserved_blocks < BLOCKS
    assert not region.path.exists()
    assert not _mapping_open(region)
    assert region.wait_reserved(timeout_s=0)
    # Stopped by shutdown, not by a failure: nothing to warn about.
    assert not any(r.levelname == "WARNING" for r in ec_log.records)
    watcher.close()


def test_cleanup_removes_the_file_before_it_waits_for_the_reservation(
    region_dir: Path, prefault_gate: PrefaultGate
) -> None:
    """The wait for a slow chunk may last up to `STOP_TIMEOUT_S`, longer than the
    5 s vLLM gives a shutting-down engine before its SIGKILL: the file goes first."""
    region = ECSharedRegion(
        "slow-stop", BLOCKS, BLOCK, directory=region_dir, background_reserve=True
    )
    prefault_gate.base = region.base_address - HEADER_BYTES
    assert prefault_gate.entered.wait(DEADLINE_S)
    closer = threading.Thread(target=region.cleanup)
    closer.start()
    try:
        assert region._stop.wait(DEADLINE_S)
        assert closer.is_alive(), "cleanup waits for the chunk in progress"
        assert not region.path.exists()
        assert _mapping_open(region), "the thread still pre-faults the mapping"
    finally:
        prefault_gate.release.set()
        closer.join(DEADLINE_S)
    assert not closer.is_alive() and not _mapping_open(region)


def test_cleanup_hands_the_unmap_to_a_thread_that_does_not_stop_in_time(
    region_dir: Path,
    prefault_gate: PrefaultGate,
    monkeypatch: pytest.MonkeyPatch,
    ec_log: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(page_reserver, "STOP_TIMEOUT_S", 0.0)
    region = ECSharedRegion("stuck", BLOCKS, BLOCK, directory=region_dir, background_reserve=True)
    prefault_gate.base = region.base_address - HEADER_BYTES
    assert prefault_gate.entered.wait(DEADLINE_S)
    reserver = region._reserver
    assert reserver is not None
    region.cleanup()  # returns although the thread is still inside a chunk
    assert region.closed and reserver.is_alive()
    assert _mapping_open(region), "unmapped under a thread still touching it"
    assert not region.path.exists()
    assert any("did not stop within" in r.getMessage() for r in ec_log.records)
    prefault_gate.release.set()
    reserver.join(DEADLINE_S)
    assert not reserver.is_alive()
    assert not _mapping_open(region) and region._fd is None, "the thread released it"
    assert region.wait_reserved(timeout_s=0)


def test_the_thread_always_ends_the_reservation(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even when publishing the stop fails too, `wait_reserved()` returns."""

    def eio(address: int, length: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    def no_record(fd: int, reservation: Reservation) -> None:
        if reservation.state != ReservationState.RUNNING:
            raise OSError(errno.EIO, "I/O error")
        real_write(fd, reservation)

    real_write = page_reserver.write_record
    monkeypatch.setattr(page_reserver, "_populate_write_address", eio)
    monkeypatch.setattr(page_reserver, "write_record", no_record)
    with ECSharedRegion(
        "ends", BLOCKS, BLOCK, directory=region_dir, background_reserve=True
    ) as region:
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (region.wait_reserved(), done.set()))
        waiter.start()
        assert done.wait(DEADLINE_S), "wait_reserved() without a timeout hung"
        waiter.join(DEADLINE_S)
        assert region.reserved_blocks == 4
        assert region.reservation_error is not None


def test_without_background_reserve_every_page_is_reserved_up_front(
    region_dir: Path, gate: Gate
) -> None:
    with ECSharedRegion("sync", BLOCKS, BLOCK, directory=region_dir) as region:
        assert region._reserver is None
        assert gate.calls == [(0, HEADER_BYTES + BLOCKS * BLOCK)]
        assert region.reserved_blocks == BLOCKS and region.wait_reserved(timeout_s=0)
        assert _watcher(region).poll() == BLOCKS


def test_touching_pages_is_never_left_to_the_background(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither fallocate nor MADV_POPULATE_WRITE: touching a page of a full
    tmpfs is a SIGBUS, so every page is touched before the constructor returns."""

    def unsupported(*args: object) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    def no_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    touched: list[tuple[int, int | None]] = []
    real_touch = page_reserver._touch_pages

    def touch(mapping: mmap.mmap, start: int = 0, stop: int | None = None) -> None:
        touched.append((start, stop))
        real_touch(mapping, start, stop)

    monkeypatch.setattr(region_mod.os, "posix_fallocate", no_fallocate)
    monkeypatch.setattr(page_reserver, "_populate_write", unsupported)
    monkeypatch.setattr(page_reserver, "_touch_pages", touch)
    with ECSharedRegion(
        "touch", BLOCKS, BLOCK, directory=region_dir, background_reserve=True
    ) as region:
        assert region._reserver is None
        assert touched == [(0, None)], "every page, before the constructor returned"
        assert region.reserved_blocks == BLOCKS


def test_the_watcher_ignores_a_missing_or_dead_engines_file(region_dir: Path) -> None:
    region = ECSharedRegion("dead", BLOCKS, BLOCK, directory=region_dir, background_reserve=True)
    watcher = _watcher(region)
    path = region.path
    assert region.wait_reserved(DEADLINE_S)
    region.cleanup()
    assert watcher.poll() == 0 and not watcher.final  # no file yet
    # A dead engine's file: right name and header, fully reserved, but nobody maps it.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, HEADER_BYTES + BLOCKS * BLOCK)
        digest = region._digest
        os.pwrite(fd, region_mod.pack_header(BLOCK, BLOCKS, digest), 0)
        os.pwrite(fd, pack_record(Reservation(BLOCKS, ReservationState.COMPLETE)), RECORD_OFFSET)
    finally:
        os.close(fd)
    assert watcher.poll() == 0 and not watcher.final, "a stale file's record is not trusted"
    os.unlink(path)


def test_poll_never_raises(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch, ec_log: pytest.LogCaptureFixture
) -> None:
    from ec_core.region import reservation as reservation_mod

    with ECSharedRegion(
        "poll", BLOCKS, BLOCK, directory=region_dir, background_reserve=True
    ) as region:
        assert region.wait_reserved(DEADLINE_S)
        watcher = _watcher(region)

        def broken(*args: object, **kwargs: object) -> object:
            raise OSError(errno.EIO, "I/O error")

        for name in ("pread", "fstat", "open"):
            with monkeypatch.context() as patch:
                patch.setattr(reservation_mod.os, name, broken)
                assert watcher.poll() == 0 and not watcher.final
                assert watcher._fd is None, "no descriptor kept after a failure"
        with monkeypatch.context() as patch:
            patch.setattr(reservation_mod.fcntl, "flock", broken)
            assert watcher.poll() == 0 and not watcher.final
        assert any("cannot read the reservation" in r.getMessage() for r in ec_log.records)
        assert watcher.poll() == BLOCKS and watcher.final  # recovers once the calls work


def test_a_torn_record_is_ignored() -> None:
    good = pack_record(Reservation(7, ReservationState.RUNNING))
    assert unpack_record(good) == Reservation(7, ReservationState.RUNNING)
    torn = good[:8] + pack_record(Reservation(9, ReservationState.COMPLETE))[8:]
    assert unpack_record(torn) is None
    assert unpack_record(b"\0" * len(good)) is None
    assert unpack_record(good[:-1]) is None


def test_the_creator_publishes_the_record_in_the_file(region_dir: Path) -> None:
    with ECSharedRegion("rec", 4, BLOCK, directory=region_dir, background_reserve=True) as region:
        assert region._fd is not None
        assert read_record(region._fd) == Reservation(4, ReservationState.COMPLETE)


# ------------------------------------------------------------- real tmpfs

MIB = 1 << 20


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 8 MiB tmpfs (needs the privilege to mount; skipped without it)."""
    with mounted_tmpfs(tmp_path / "shm8", 8) as mount_point:
        yield mount_point


def test_a_tmpfs_filled_during_the_reservation_never_causes_a_sigbus(small_tmpfs: Path) -> None:
    """A real ENOSPC from the kernel partway: the reservation stops at the
    watermark and writing every block below it works (no SIGBUS)."""
    code = textwrap.dedent(
        f"""
        import os, threading
        from ec_core.region import page_reserver
        from ec_core.region.mapping import ECSharedRegion
        page_reserver.SYNC_RESERVE_BYTES = 2 * {MIB}
        page_reserver.CHUNK_BYTES = {MIB}
        real, release = os.posix_fallocate, threading.Event()
        def gated(fd, offset, length):
            if offset >= 2 * {MIB}:
                assert release.wait(60)
            real(fd, offset, length)
        os.posix_fallocate = gated
        region = ECSharedRegion(
            "full", (6 * {MIB}) // 4096, 4096,
            directory={str(small_tmpfs)!r}, background_reserve=True,
        )
        filler = os.open({str(small_tmpfs / "filler")!r}, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            while True:
                os.write(filler, b"x" * 65536)
        except OSError:
            pass
        os.close(filler)
        release.set()
        assert region.wait_reserved(60)
        reserved = region.reserved_blocks
        assert 0 < reserved < region.num_blocks, reserved
        assert region.reservation_error is not None
        region.blocks[:reserved].fill_(7)  # touches every reserved page
        assert int(region.blocks[reserved - 1, -1]) == 7
        region.cleanup()
        print("wrote", reserved, "of", region.num_blocks)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode != -signal.SIGBUS, "a write into the region faulted"
    assert done.returncode == 0, done.stderr[-2000:]
    reserved = (2 * MIB - HEADER_BYTES) // 4096  # the synchronous front, header excluded
    assert f"wrote {reserved} of 1536" in done.stdout, done.stdout


def test_a_thread_that_cannot_start_leaves_no_file(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread left for the background reservation: the constructor raises
    that error and undoes the creation (no file, no descriptor holding its lock)."""

    def no_threads(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    opened_before = len(os.listdir("/proc/self/fd"))
    with monkeypatch.context() as patch:
        patch.setattr(threading.Thread, "start", no_threads)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            ECSharedRegion("nothread", BLOCKS, BLOCK, directory=region_dir, background_reserve=True)
    assert os.listdir(region_dir) == []
    assert len(os.listdir("/proc/self/fd")) == opened_before, "a descriptor was leaked"
    with ECSharedRegion(
        "nothread", BLOCKS, BLOCK, directory=region_dir, background_reserve=True
    ) as region:
        assert region.is_creator


def test_a_region_that_never_appears_is_warned_about(
    region_dir: Path, monkeypatch: pytest.MonkeyPatch, ec_log: pytest.LogCaptureFixture
) -> None:
    """A scheduler whose host runs no worker of its engine never sees the region: it
    saves nothing, so once that has lasted past ABSENT_WARN_S it says so (once a
    period), instead of leaving the operator with a cache that silently stays empty."""
    from ec_core.region import reservation as reservation_mod

    watcher = RegionReservation(
        region_dir / "never-created.ecregion", BLOCKS, BLOCK, engine_id="e", owner="o"
    )
    assert watcher.poll() == 0
    assert not any("has not appeared" in r.getMessage() for r in ec_log.records), "too early"
    monkeypatch.setattr(reservation_mod, "ABSENT_WARN_S", 0.0)
    assert watcher.poll() == 0 and watcher.poll() == 0 and not watcher.final
    warned = [r for r in ec_log.records if "has not appeared" in r.getMessage()]
    assert len(warned) == 1 and "never-created.ecregion" in warned[0].getMessage()
