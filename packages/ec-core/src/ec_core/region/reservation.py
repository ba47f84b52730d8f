"""How far a region's pages are reserved, shared between processes through its header.

The creator of a region (`ec_core.region.page_reserver`) reserves the block area
from the front (with `background_reserve`, chunk by chunk in a background
thread) and publishes after each chunk the *watermark*: how many blocks,
counted from block 0, are backed by reserved pages.

The invariant (stated here once; the other modules refer to it): a write to
a block below the watermark can never fault with SIGBUS, however full the
directory gets afterwards; a block at or above it may, so nothing writes
there. Two layers keep to it: the scheduler (`RegionReservation`, another
process) reads the watermark and lets its allocator hand out only blocks
below it, and the worker that writes refuses (fails) a save that reaches
the watermark it last read (`ec_core.worker_process.worker`).

The record lives in the header page, after the header proper, at
`RECORD_OFFSET`, and is written and read with `pwrite`/`pread` (never through
a mapping). It carries a check word, so a read torn by a concurrent write is
recognised and ignored. The watermark never decreases.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from ec_core._vllm import get_logger
from ec_core.ratelimit import RateLimitedWarnings
from ec_core.region.files import (
    HEADER,
    HEADER_BYTES,
    RegionError,
    check_header,
    check_owned_regular_file,
    owner_digest,
)
from ec_core.sizes import format_bytes

logger = get_logger(__name__)

RECORD = struct.Struct("<QQQ")
"""reserved blocks, state, check word."""
RECORD_OFFSET = 128
"""Where the record sits in the header page (after `HEADER`, inside `HEADER_BYTES`)."""
ABSENT_WARN_S = 60.0
"""How long the scheduler follows a region file that does not appear before it warns:
the workers create the region before vLLM builds the scheduler, so a file still
missing then means no worker of this engine runs on the scheduler's host."""

_CHECK_SALT = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1

assert HEADER.size <= RECORD_OFFSET and RECORD_OFFSET + RECORD.size <= HEADER_BYTES


class ReservationState(enum.IntEnum):
    """Where the creator's reservation stands."""

    RUNNING = 0
    """More blocks may still come."""
    COMPLETE = 1
    """Every block is reserved."""
    FAILED = 2
    """The reservation ended early because the directory filled up or a call
    failed: final, and worth a warning (the cache is smaller than configured)."""
    CANCELLED = 3
    """`cleanup()` stopped the reservation (the engine is shutting down): final."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """One reading of the record: `reserved_blocks` from block 0 are backed."""

    reserved_blocks: int
    state: ReservationState

    @property
    def final(self) -> bool:
        """True when the watermark will not move again."""
        return self.state != ReservationState.RUNNING


def _check_word(reserved_blocks: int, state: int) -> int:
    return ((reserved_blocks * _CHECK_SALT) ^ (state + 1) ^ _CHECK_SALT) & _MASK


def pack_record(reservation: Reservation) -> bytes:
    """The record's bytes for `reservation`."""
    state = int(reservation.state)
    return RECORD.pack(
        reservation.reserved_blocks, state, _check_word(reservation.reserved_blocks, state)
    )


def unpack_record(raw: bytes) -> Reservation | None:
    """The reservation `raw` holds, or None when it is torn or not a record."""
    if len(raw) != RECORD.size:
        return None
    reserved, state, check = RECORD.unpack(raw)
    if check != _check_word(reserved, state) or state not in ReservationState._value2member_map_:
        return None
    return Reservation(reserved, ReservationState(state))


def write_record(fd: int, reservation: Reservation) -> None:
    """Publish `reservation` in the region file open as `fd`."""
    os.pwrite(fd, pack_record(reservation), RECORD_OFFSET)


def read_record(fd: int) -> Reservation | None:
    """The reservation published in the region file open as `fd` (None if torn)."""
    return unpack_record(os.pread(fd, RECORD.size, RECORD_OFFSET))


class RegionReservation:
    """The scheduler's view of one region's watermark, read from its file.

    Guarantee: `poll()` never returns more blocks than the live region file
    of this identity has reserved (the watermark of the first such file it
    finds; the writing worker's own check covers a file replaced after
    that). Before that file exists (or while it cannot be verified as this
    engine's live region), it returns 0. It never raises and never blocks: a
    failing system call is a rate-limited warning and leaves the watermark
    where it was; each call costs at most a few system calls, and none once
    the watermark is final.
    """

    def __init__(
        self,
        path: Path,
        num_blocks: int,
        block_size_bytes: int,
        *,
        engine_id: str,
        owner: str,
    ) -> None:
        self.path = path
        self.num_blocks = num_blocks
        self.block_size_bytes = block_size_bytes
        self._digest = owner_digest(engine_id, owner, num_blocks, block_size_bytes)
        self._fd: int | None = None
        self.reserved_blocks = 0
        self.final = False
        self._warnings = RateLimitedWarnings(logger)
        self._absent_since = time.monotonic()

    def poll(self) -> int:
        """The blocks reserved so far (monotonic); sets `final` when it stops moving."""
        if self.final:
            return self.reserved_blocks
        try:
            self._poll()
        except Exception as exc:  # OSError in practice; never into schedule()
            self._warnings.warn(
                "poll",
                "EC CPU tier: cannot read the reservation of %s (keeping %d blocks): %s",
                self.path,
                self.reserved_blocks,
                exc,
            )
            self.close()  # reopened and verified afresh next time
        return self.reserved_blocks

    def _poll(self) -> None:
        if self._fd is None:
            self._fd = self._open_live()
            if self._fd is None:
                if not self.reserved_blocks and self._absent_for() > ABSENT_WARN_S:
                    self._warnings.warn(
                        "absent",
                        "EC CPU tier: region %s has not appeared in %.0f s; nothing is "
                        "saved until it does (does a worker of this engine run on the "
                        "scheduler's host, with the same ec_cpu_dir?)",
                        self.path,
                        self._absent_for(),
                    )
                return
        reading = read_record(self._fd)
        if reading is None:
            return  # torn by a concurrent update: next time
        self.reserved_blocks = max(
            self.reserved_blocks, min(reading.reserved_blocks, self.num_blocks)
        )
        if reading.final:
            self.final = True
            if reading.state == ReservationState.FAILED:
                self._warnings.warn(
                    "stopped",
                    "EC CPU tier: only %d of %d region blocks (%s of %s) could be reserved "
                    "in %s; the cache works with that much (free space in the directory "
                    "or lower ec_cpu_bytes to get the rest)",
                    self.reserved_blocks,
                    self.num_blocks,
                    format_bytes(self.reserved_blocks * self.block_size_bytes),
                    format_bytes(self.num_blocks * self.block_size_bytes),
                    self.path.parent,
                )
            self.close()

    def _absent_for(self) -> float:
        return time.monotonic() - self._absent_since

    def close(self) -> None:
        """Stop following the file (idempotent, never raises)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _open_live(self) -> int | None:
        """Open the region file if it is this engine's and a live process maps it.

        Checked under the directory lock (taken without waiting), so the
        stale-file sweep of a creator cannot run in between: a file that no
        process holds is a dead engine's, whose record must not be trusted.
        """
        try:
            dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # a region is being created or joined: next time
            try:
                return self._open_verified(dir_fd)
            finally:
                with contextlib.suppress(OSError):
                    fcntl.flock(dir_fd, fcntl.LOCK_UN)
        finally:
            with contextlib.suppress(OSError):
                os.close(dir_fd)

    def _open_verified(self, dir_fd: int) -> int | None:
        try:
            fd = os.open(self.path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP):
                self._warnings.warn("open", "EC CPU tier: cannot open %s: %s", self.path, exc)
            return None
        keep = False
        try:
            check_owned_regular_file(fd, self.path)
            if os.fstat(fd).st_size != HEADER_BYTES + self.num_blocks * self.block_size_bytes:
                raise RegionError(f"region {self.path} has the wrong size")
            check_header(
                os.pread(fd, HEADER.size, 0),
                self.path,
                self.block_size_bytes,
                self.num_blocks,
                self._digest,
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                keep = True  # held: a live process maps it
                return fd
            fcntl.flock(fd, fcntl.LOCK_UN)  # nobody maps it: a dead engine's
        except RegionError as exc:
            self._warnings.warn("foreign", "EC CPU tier: not following %s: %s", self.path, exc)
        finally:
            if not keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return None
