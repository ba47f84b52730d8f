"""The opt-in access log (`ec_scheduler.access_log`): what a consumer's scheduler
records, what it never writes, and its bounds in memory, on disk and on errors."""

from __future__ import annotations

import errno
import io
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest

from ec_core.ratelimit import RateLimitedWarnings
from ec_core.settings import DEFAULT_ACCESS_LOG_MAX_BYTES, ECCPUSettings
from ec_scheduler import ECCPUScheduler, access_log
from ec_scheduler.access_log import AccessLog, log_path
from ec_scheduler.access_log_format import MAGIC
from ec_scheduler.sizing import read_log
from ec_scheduler.tenancy import SALT_MARK
from ectools.driving import Item, SimulatedRanks, StepDriver, connector_output, make_request

from .conftest import BLOCK, WIDTH

SchedulerFactory = Callable[..., ECCPUScheduler]
H1, H2 = "a1" * 32, "b2" * 32
SALT = "tenant-Z-salt-4471"
NEVER = 3600.0
"""A writer interval no test waits for: the writer drains on `close` only."""


def _step(scheduler: ECCPUScheduler, requests: list[tuple[str, list[Item], str | None]]) -> None:
    """One step of `requests` (id, items, salt), its copies reported landed."""
    made = [make_request(rid, items, cache_salt=salt) for rid, items, salt in requests]
    meta = StepDriver(scheduler).step(made).meta
    scheduler.update_connector_output(connector_output(SimulatedRanks().report(meta)))


def _records(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines() if not line.startswith("#")]


def _quiet_log(
    path: Path,
    *,
    max_bytes: int = 1 << 20,
    buffer_records: int = 1024,
    interval_s: float = NEVER,
    open_file: Callable[[Path], BinaryIO] | None = None,
) -> AccessLog:
    """A log whose writer (by default) drains only when closed: no test depends on
    its timing."""
    return AccessLog(
        path,
        max_bytes,
        block_bytes=BLOCK,
        buffer_records=buffer_records,
        interval_s=interval_s,
        open_file=open_file,
    )


def _wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the writer did not get there"
        time.sleep(0.005)


# ------------------------------------------------------------- the scheduler


def test_the_log_records_each_item_the_scheduler_counts(
    make_scheduler: SchedulerFactory, tmp_path: Path
) -> None:
    """A miss (saved), a hit of it, a duplicate in one step (one lookup), another item:
    one record per lookup the scheduler counts, each with the item's rows and bytes."""
    path = tmp_path / "access.log"
    scheduler = make_scheduler(ec_access_log=str(path))
    assert scheduler.access_log is not None and scheduler.access_log.path == path
    _step(scheduler, [("r1", [Item(H1, embeds=8)], None)])
    _step(scheduler, [("r2", [Item(H1, embeds=8)], None), ("r3", [Item(H2, embeds=5)], None)])
    _step(scheduler, [("r4", [Item(H2, embeds=5)], None), ("r5", [Item(H2, embeds=5)], None)])
    lookups = scheduler.counters.lookups
    scheduler.shutdown()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    header = path.read_text().splitlines()[0]
    assert header.startswith(f"{MAGIC} 1 block_bytes={BLOCK} ")
    records = _records(path)
    assert len(records) == lookups == 4
    digests = [record[1] for record in records]
    assert digests[0] == digests[1] != digests[2] == digests[3], "one digest per key"
    assert [(int(r[2]), int(r[3])) for r in records] == [
        (8, 8 * WIDTH * 4),
        (8, 8 * WIDTH * 4),
        (5, 5 * WIDTH * 4),
        (5, 5 * WIDTH * 4),
    ], "rows and bytes (rows x the modality's width x fp32)"
    times = [float(r[0]) for r in records]
    assert times == sorted(times) and times[0] >= 0
    assert scheduler.counters.hits == 2


def test_the_log_never_holds_an_identifier_a_salt_or_a_salted_key(
    make_scheduler: SchedulerFactory, tmp_path: Path
) -> None:
    path = tmp_path / "access.log"
    scheduler = make_scheduler(ec_access_log=str(path))
    salted = scheduler.tier_keys.key(
        make_request("k", [Item(H1)], cache_salt=SALT),
        make_request("k", [Item(H1)], cache_salt=SALT).mm_features[0],
    )
    suffix = salted[len(H1) :]
    _step(scheduler, [("a", [Item(H1)], SALT)])
    _step(scheduler, [("b", [Item(H1)], SALT)])
    _step(scheduler, [("c", [Item(H1)], None)])
    scheduler.shutdown()
    data = path.read_bytes()
    for secret in (H1, SALT, salted, suffix, suffix[len(SALT_MARK) :], SALT_MARK, H1[:16]):
        assert secret.encode() not in data, secret
    digests = [record[1] for record in _records(path)]
    assert digests[0] == digests[1] != digests[2], "the salted key and the plain one differ"
    assert all(len(digest) == 16 for digest in digests)


def test_a_log_is_keyed_per_file(tmp_path: Path) -> None:
    """The same key has one digest within a file, and another in the next file."""
    one, two = _quiet_log(tmp_path / "one"), _quiet_log(tmp_path / "two")
    assert one.digest(H1) == one.digest(H1) != two.digest(H1)
    one.close()
    two.close()


def test_only_a_consumer_logs(
    make_scheduler: SchedulerFactory, tmp_path: Path, ec_log: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "access.log"
    scheduler = make_scheduler(role="ec_producer", ec_access_log=str(path))
    assert scheduler.access_log is None and not path.exists()
    assert "nothing to log" in ec_log.text
    scheduler.shutdown()


def test_a_log_that_cannot_be_created_leaves_the_engine_running(
    make_scheduler: SchedulerFactory,
    tmp_path: Path,
    ec_log: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def read_only(path: Path) -> BinaryIO:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(access_log, "create_owner_only", read_only)
    scheduler = make_scheduler(ec_access_log=str(tmp_path / "access.log"))
    assert scheduler.access_log is None
    assert "cannot create the access log" in ec_log.text
    _step(scheduler, [("r", [Item(H1)], None)])
    _step(scheduler, [("r2", [Item(H1)], None)])
    assert scheduler.counters.hits == 1
    scheduler.shutdown()


def test_shutdown_writes_out_what_is_queued(
    make_scheduler: SchedulerFactory, tmp_path: Path
) -> None:
    path = tmp_path / "access.log"
    scheduler = make_scheduler()
    scheduler.access_log = _quiet_log(path)
    for n in range(5):
        _step(scheduler, [(f"r{n}", [Item(f"{n:064x}")], None)])
    assert _records(path) == [], "nothing written before the writer runs"
    scheduler.shutdown()
    assert len(_records(path)) == 5
    scheduler.shutdown()  # idempotent


class _FullDisk(io.BytesIO):
    """A file whose writes fail with ENOSPC once `room` bytes are written."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def write(self, data: object) -> int:
        size = len(data)  # type: ignore[arg-type]
        if self.tell() + size > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)  # type: ignore[arg-type]

    def writelines(self, lines: object) -> None:
        for line in lines:  # type: ignore[attr-defined]
            self.write(line)


def test_a_full_disk_turns_the_log_off_and_the_engine_serves_on(
    make_scheduler: SchedulerFactory, tmp_path: Path, ec_log: pytest.LogCaptureFixture
) -> None:
    disk = _FullDisk(room=300)  # the header and a few records
    scheduler = make_scheduler()
    log = _quiet_log(tmp_path / "x", interval_s=0.001, open_file=lambda _: disk)
    scheduler.access_log = log
    for n in range(20):
        _step(scheduler, [(f"r{n}", [Item(f"{n:064x}")], None)])
    _wait_until(lambda: not log.on)
    assert "No space left on device" in ec_log.text and "the log is off" in ec_log.text
    assert log._thread.is_alive(), "the writer lives on (and ends at shutdown)"
    _step(scheduler, [("after", [Item(H1)], None)])
    assert not log._queue, "records after the error are not queued"
    _step(scheduler, [("again", [Item(H1)], None)])
    assert scheduler.counters.hits == 1, "the tier works on"
    scheduler.shutdown()
    assert not log._thread.is_alive()


def test_the_file_never_exceeds_its_bound(tmp_path: Path, ec_log: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "bounded.log"
    log = _quiet_log(path, max_bytes=4096)
    for n in range(1000):
        log.record(f"key-{n}", 10, 5120)
    log.close()
    size = path.stat().st_size
    assert 4096 - 40 < size <= 4096, "filled up to the bound, not past it"
    assert not log.on and 0 < log.written < 1000
    assert len(_records(path)) == log.written
    assert ec_log.text.count("reached ec_access_log_max_bytes") == 1
    log.record("late", 1, 1)
    assert not log._queue


def test_a_full_queue_drops_and_counts(tmp_path: Path, ec_log: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "drops.log"
    log = _quiet_log(path, buffer_records=4)
    for n in range(10):
        log.record(f"key-{n}", 1, 512)
    assert len(log._queue) == 4 and log.dropped == 6
    log.close()
    assert log.written == 4 and len(_records(path)) == 4
    assert "6 records dropped" in ec_log.text
    read = read_log(path)
    assert read.dropped == 6 and len(read.digests) == 4, "the file says it lacks six"


def test_drops_a_held_back_warning_missed_are_told_at_close(
    tmp_path: Path, ec_log: pytest.LogCaptureFixture
) -> None:
    """The rate limit holds back the second warning; the file and `close` still give
    the total."""
    path = tmp_path / "drops.log"
    log = _quiet_log(path, buffer_records=4)
    limiter = RateLimitedWarnings(access_log.logger, clock=lambda: 0.0)
    log._warn = limiter.warn
    for round_ in range(2):
        for n in range(10):
            log.record(f"key-{round_}-{n}", 1, 512)
        log._drain()  # the writer's pass (its own thread waits for `close`)
    assert log.dropped == 12
    assert "6 records dropped" in ec_log.text and "12 records dropped" not in ec_log.text
    for _ in range(5):
        log._drain()  # passes that drop nothing more hold back no more warnings
    assert limiter._held == {"dropped": 1}
    log.close()
    assert "lacks 12 records in all" in ec_log.text
    read = read_log(path)
    assert read.dropped == 12 and len(read.digests) == 8


class _StalledDisk(io.BytesIO):
    """A file whose writes hang until `release` is set, holding the lock its `close`
    takes too (as a buffered file on a filesystem that stopped answering does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.writing = threading.Event()
        self.release = threading.Event()

    def writelines(self, lines: object) -> None:
        with self.lock:
            self.writing.set()
            self.release.wait()
            super().writelines(lines)  # type: ignore[arg-type]

    def close(self) -> None:
        with self.lock:
            super().close()


def test_a_stalled_disk_does_not_hold_up_shutdown(
    tmp_path: Path, ec_log: pytest.LogCaptureFixture
) -> None:
    disk = _StalledDisk()
    log = AccessLog(
        tmp_path / "x",
        1 << 20,
        block_bytes=BLOCK,
        interval_s=0.001,
        open_file=lambda _: disk,
        close_timeout_s=0.01,
    )
    try:
        log.record("key", 1, 512)
        assert disk.writing.wait(30), "the writer never wrote"
        closing = threading.Thread(target=log.close)
        closing.start()
        closing.join(30)
        assert not closing.is_alive(), "close waited on the stalled disk"
        assert "stuck writing" in ec_log.text and not log.on
        log.record("after", 1, 512)
        assert not log._queue
    finally:
        disk.release.set()
    log._thread.join(30)
    assert not log._thread.is_alive() and disk.closed, "the writer closes the file on its way out"


def test_the_file_replaces_a_link_instead_of_following_it(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("precious")
    link = tmp_path / "access.log"
    link.symlink_to(target)
    log = _quiet_log(link)
    log.close()
    assert target.read_text() == "precious"
    assert not link.is_symlink() and stat.S_IMODE(link.stat().st_mode) == 0o600
    assert read_log(link).digests == []


def test_engines_of_a_data_parallel_deployment_write_apart() -> None:
    assert log_path(Path("/l/a.log"), 0) == Path("/l/a.log")
    assert log_path(Path("/l/a.log"), 3) == Path("/l/a.log.dp3")


# ------------------------------------------------------------------ settings


def test_the_settings_default_off_and_refuse_bad_values(tmp_path: Path) -> None:
    base = {"ec_cpu_bytes": 4096}
    settings = ECCPUSettings.from_extra_config(base, block_size_bytes=512)
    assert settings.access_log is None
    assert settings.access_log_max_bytes == DEFAULT_ACCESS_LOG_MAX_BYTES == 64 * 2**20
    good = ECCPUSettings.from_extra_config(
        {**base, "ec_access_log": str(tmp_path / "a.log"), "ec_access_log_max_bytes": "1MiB"},
        block_size_bytes=512,
    )
    assert good.access_log == tmp_path / "a.log" and good.access_log_max_bytes == 2**20
    for bad in (5, True, "", "  ", str(tmp_path), str(tmp_path / "missing" / "a.log")):
        with pytest.raises(ValueError, match="ec_access_log"):
            ECCPUSettings.from_extra_config({**base, "ec_access_log": bad}, block_size_bytes=512)
    for bad_size in (0, "0", True, "1KiB", 4095, "lots", -1):
        with pytest.raises(ValueError, match="ec_access_log_max_bytes"):
            ECCPUSettings.from_extra_config(
                {**base, "ec_access_log_max_bytes": bad_size}, block_size_bytes=512
            )
    assert not list(tmp_path.iterdir()), "nothing created while checking"


class _Broken(io.BytesIO):
    """A file whose writes after the header fail with an error no writer expects."""

    def writelines(self, lines: object) -> None:
        raise RuntimeError("a bug")


def test_a_bug_in_the_writer_costs_the_log_not_the_engine(
    tmp_path: Path, ec_log: pytest.LogCaptureFixture
) -> None:
    log = _quiet_log(tmp_path / "x", interval_s=0.001, open_file=lambda _: _Broken())
    log.record("key", 1, 512)
    _wait_until(lambda: not log.on)
    assert "the access log's writer failed" in ec_log.text
    log.record("later", 1, 512)
    assert not log._queue
    log.close()
