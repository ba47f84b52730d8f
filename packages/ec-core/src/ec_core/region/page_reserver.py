"""Reserving a new region's pages, so that no write to the region can fault.

The creator of a region (`ec_core.region.mapping.ECSharedRegion`) reserves
the file's pages (fallocate) and pre-faults them writable
(`MADV_POPULATE_WRITE`, or by touching each page where the kernel lacks it),
so that a directory that cannot hold them fails at start-up, not as a SIGBUS
later. With `background_reserve`, start-up does not wait for the whole region:
the first `SYNC_RESERVE_BYTES` are reserved before the constructor returns and
the rest from the front in a background thread, publishing the watermark as it
goes (`ec_core.region.reservation` states what the watermark guarantees).
Without it every page is reserved before the constructor returns, as a process
that registers the whole mapping with a device or NIXL right away needs.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from pathlib import Path

import torch

from ec_core._vllm import get_logger
from ec_core.ratelimit import RateLimitedWarnings
from ec_core.region.files import HEADER_BYTES
from ec_core.region.reservation import (
    Reservation,
    ReservationState,
    read_record,
    write_record,
)
from ec_core.settings import KEY_CPU_BYTES
from ec_core.sizes import format_bytes

logger = get_logger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MIB = 1 << 20
SYNC_RESERVE_BYTES = 32 * _MIB
"""The front of the file (header included) reserved before the constructor returns
(rounded down to whole pages)."""
CHUNK_BYTES = 64 * _MIB
"""What the background reservation reserves between two watermark updates (whole
pages): `cleanup()` normally waits for at most one chunk."""
STOP_TIMEOUT_S = 10.0
"""The longest `cleanup()` waits for the background reservation to stop; past it,
the thread unmaps the region itself when it ends."""
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)
_JOIN_POLL_S = 0.01


class PageReserver:
    """The reservation of a region's pages: the front before the constructor
    returns, the rest up front or in a background thread (a part of
    `ECSharedRegion`, which states the guarantees and sets the geometry below).

    The background thread only ever touches pages above the published
    watermark, and the mapping stays valid while it runs: `_stop_reservation`
    lets the region unmap only after the thread ended, or hands the unmap to
    the thread.
    """

    engine_id: str
    num_blocks: int
    block_size_bytes: int
    nbytes: int
    file_bytes: int
    directory: Path
    path: Path
    is_creator: bool
    _fd: int | None
    _mmap: mmap.mmap | None
    _closed: bool

    def _init_reservation(self, background_reserve: bool) -> None:
        """Set the reservation's state: nothing reserved yet, no thread."""
        # Page aligned, so every background chunk starts on a page boundary.
        sync_bytes = max(HEADER_BYTES, SYNC_RESERVE_BYTES // mmap.PAGESIZE * mmap.PAGESIZE)
        self._sync_end = min(self.file_bytes, sync_bytes) if background_reserve else self.file_bytes
        self._fallocate_works = True
        self._populate_works = True
        self._reserved_blocks = 0
        self._published_offset = 0
        self._reservation_error: OSError | None = None
        self._stop = threading.Event()
        self._reservation_over = threading.Event()
        self._reserver: threading.Thread | None = None
        self._handoff = threading.Lock()
        self._reserver_done = False  # guarded by _handoff
        self._unmap_when_done = False  # guarded by _handoff: cleanup() gave up waiting
        self._warnings = RateLimitedWarnings(logger)

    def _release_mapping(self) -> None:
        """Unmap the region and close its descriptor (`ECSharedRegion` provides it)."""
        raise NotImplementedError

    def _reserve_front(self, fd: int) -> None:
        """Reserve the front of the new file (`_sync_end` bytes): all of it without
        `background_reserve`. A directory that cannot hold it raises ValueError."""
        try:
            # Reserve the front now: on tmpfs this fails with ENOSPC instead of
            # letting a later write fault with SIGBUS. The rest is reserved in
            # the background (`_reserve_rest`).
            os.posix_fallocate(fd, 0, self._sync_end)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                raise ValueError(
                    f"ec_connector_extra_config[{KEY_CPU_BYTES!r}] asks for {self.nbytes} bytes "
                    f"({format_bytes(self.nbytes)}) which {self.directory} cannot hold: {exc}"
                ) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            logger.warning(
                "%s does not support fallocate; region pages are reserved by pre-faulting",
                self.directory,
            )
            self._fallocate_works = False

    def _prefault(self) -> None:
        """Fault in the synchronously reserved front of the file, writable."""
        assert self._mmap is not None
        try:
            _populate_write(self._mmap, 0, mmap.PAGESIZE)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            logger.warning(
                "MADV_POPULATE_WRITE is not supported by this kernel; pre-faulting "
                "the EC CPU region one page at a time"
            )
            self._populate_works = False
            if not self._fallocate_works and self._sync_end < self.file_bytes:
                # Nothing reserves pages but touching them, and touching an
                # unreserved page of a full tmpfs is a SIGBUS: reserve them all
                # now, while a failure is still a start-up failure.
                self._sync_end = self.file_bytes
            if self._sync_end == self.file_bytes:
                _touch_pages(self._mmap)
            else:
                _touch_pages(self._mmap, 0, self._sync_end)
            return
        try:
            _populate_write(self._mmap, 0, self._sync_end)
        except OSError as exc:
            # Where fallocate is not supported, this is what reserves the front: a
            # directory that cannot hold it fails here (ENOMEM, or EFAULT for a
            # page it cannot back), the same start-up error as fallocate's ENOSPC.
            if exc.errno not in (*_FULL_ERRNOS, errno.EFAULT):
                raise
            raise ValueError(
                f"ec_connector_extra_config[{KEY_CPU_BYTES!r}] asks for {self.nbytes} bytes "
                f"({format_bytes(self.nbytes)}) which {self.directory} cannot hold: {exc}"
            ) from exc

    def _start_reservation(self, map_address: int) -> None:
        """Publish the front; start the background reservation of the rest, if any.

        `map_address` is the address of the file's first byte in this process."""
        self._publish(self._sync_end)
        if self._sync_end < self.file_bytes:
            reserver = threading.Thread(
                target=self._reserve_rest,
                args=(map_address,),
                name=f"ec-region-reserve-{self.engine_id}",
                daemon=True,
            )
            reserver.start()
            # Only a started thread: a start that fails (no threads left)
            # leaves nothing for `_abort` to join, so it removes the file.
            self._reserver = reserver

    # ---------------------------------------------------------- reservation

    def _blocks_below(self, offset: int) -> int:
        """Blocks wholly inside the file's first `offset` bytes."""
        if offset >= self.file_bytes:
            return self.num_blocks
        return max(0, (offset - HEADER_BYTES) // self.block_size_bytes)

    def _publish(self, offset: int, state: ReservationState | None = None) -> None:
        """Announce that the file's first `offset` bytes are reserved (and `state`)."""
        assert self._fd is not None
        if state is None:
            done = offset >= self.file_bytes
            state = ReservationState.COMPLETE if done else ReservationState.RUNNING
        blocks = self._blocks_below(offset)
        write_record(self._fd, Reservation(blocks, state))
        self._reserved_blocks = blocks  # after the record: never ahead of it
        self._published_offset = offset
        if state != ReservationState.RUNNING:
            self._reservation_over.set()

    def _reserve_rest(self, map_address: int) -> None:
        """The background reservation: chunk by chunk from `_sync_end` to the end.

        Each chunk is reserved (fallocate, or `MADV_POPULATE_WRITE` where
        fallocate is unsupported), pre-faulted in this process, and only then
        published. Every system call here releases the GIL. Guarantees: it
        never raises; whatever happens, the reservation is over
        (`_reservation_over` set) when it returns; a failure stops it at the
        last published watermark with one warning, a `cleanup()` stops it
        silently. `map_address` stays valid while it runs: `cleanup()`
        unmaps only after this thread ends, or hands the unmap to it.
        """
        began = time.perf_counter()
        offset = self._sync_end
        try:
            self._reserve_chunks(map_address, offset)
        except Exception as exc:
            self._reservation_error = exc if isinstance(exc, OSError) else OSError(str(exc))
            try:
                self._publish(self._published_offset, ReservationState.FAILED)
            except Exception as publish_exc:
                # The record still says RUNNING: followers keep the watermark
                # they have, which is still true.
                logger.debug(
                    "EC CPU region %s: cannot publish the stop: %s", self.path, publish_exc
                )
            full = isinstance(exc, OSError) and exc.errno in (*_FULL_ERRNOS, errno.EFAULT)
            self._warnings.warn(
                "reservation",
                "EC CPU region %s: only %d of %d blocks (%s of %s) could be reserved%s: %s; "
                "the cache works with that much",
                self.path,
                self._reserved_blocks,
                self.num_blocks,
                format_bytes(self._reserved_blocks * self.block_size_bytes),
                format_bytes(self.nbytes),
                f" ({self.directory} is full)" if full else "",
                exc,
            )
        else:
            if self._reserved_blocks == self.num_blocks:
                logger.info(
                    "EC CPU region %s: all %s reserved in the background in %.1f s",
                    self.path,
                    format_bytes(self.nbytes),
                    time.perf_counter() - began,
                )
        finally:
            self._reservation_over.set()
            with self._handoff:
                self._reserver_done = True
                unmap = self._unmap_when_done
            if unmap:
                self._release_mapping()

    def _reserve_chunks(self, map_address: int, offset: int) -> None:
        """`_reserve_rest`'s loop; raises what a chunk raised."""
        assert self._fd is not None
        fd = self._fd
        chunk = max(mmap.PAGESIZE, CHUNK_BYTES // mmap.PAGESIZE * mmap.PAGESIZE)
        while offset < self.file_bytes:
            if self._stop.is_set():
                self._publish(offset, ReservationState.CANCELLED)
                logger.debug("EC CPU region %s: reservation stopped by cleanup", self.path)
                return
            end = min(offset + chunk, self.file_bytes)
            if self._fallocate_works:
                os.posix_fallocate(fd, offset, end - offset)
            if self._populate_works:
                _populate_write_address(map_address + offset, end - offset)
            else:  # fallocate reserved the chunk: touching it cannot fault
                assert self._mmap is not None
                _touch_pages(self._mmap, offset, end)
            self._publish(end)
            offset = end

    @property
    def reserved_blocks(self) -> int:
        """The watermark: blocks, counted from block 0, backed by reserved pages
        (never decreases; see `ec_core.region.reservation` for what it guarantees).

        The creator knows it directly; a joiner reads the creator's published
        record (a failed read raises OSError).
        """
        if self.is_creator or self._fd is None:
            return self._reserved_blocks
        reading = read_record(self._fd)
        if reading is not None:
            self._reserved_blocks = max(self._reserved_blocks, reading.reserved_blocks)
        return self._reserved_blocks

    @property
    def reservation_error(self) -> OSError | None:
        """Why the creator's background reservation stopped early, if it did."""
        return self._reservation_error

    def wait_reserved(self, timeout_s: float | None = None) -> bool:
        """Wait until the reservation is over (complete, failed or stopped).

        True when it is over within `timeout_s` (None: wait as long as it
        takes). Whether every block was reserved is `reserved_blocks ==
        num_blocks`.
        """
        if self.is_creator:
            return self._reservation_over.wait(timeout_s) if self._reserver else True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._closed and self._fd is not None:
            reading = read_record(self._fd)
            if reading is not None and reading.final:
                self._reserved_blocks = max(self._reserved_blocks, reading.reserved_blocks)
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(_JOIN_POLL_S)
        return False

    def _stop_reservation(self) -> bool:
        """Stop the background reservation; True once the mapping may be released.

        Waits for the thread (normally at most one chunk) up to
        `STOP_TIMEOUT_S`. A thread still running then may still touch the
        mapping: it is left mapped, the thread releases it when it ends, and
        this returns False.
        """
        self._stop.set()
        reserver = self._reserver
        if reserver is None or reserver is threading.current_thread():
            return True
        reserver.join(STOP_TIMEOUT_S)
        with self._handoff:
            if self._reserver_done:
                self._reserver = None
                return True
            self._unmap_when_done = True
        logger.warning(
            "EC CPU region %s: the background reservation did not stop within %.0f s; "
            "the region is unmapped when it does",
            self.path,
            STOP_TIMEOUT_S,
        )
        return False


def _populate_write(mapping: mmap.mmap, start: int, length: int) -> None:
    """Fault in `[start, start + length)` writable, in one system call."""
    mapping.madvise(_MADV_POPULATE_WRITE, start, length)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def _populate_write_address(address: int, length: int) -> None:
    """Fault in `[address, address + length)` writable, without holding the GIL.

    (`mmap.madvise` holds the GIL for the whole call; ctypes releases it.)
    """
    if _libc.madvise(address, length, _MADV_POPULATE_WRITE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _touch_pages(mapping: mmap.mmap, start: int = 0, stop: int | None = None) -> None:
    """Fault in every page of `[start, stop)` by rewriting its first byte with its own value.

    Read-modify-write keeps existing bytes (the header). The creator calls
    this on pages no other process writes yet: before any other process can
    map the file (it holds the directory lock), or, from the background
    reservation, on pages above the published watermark, which nobody may
    write.
    """
    pages = torch.frombuffer(mapping, dtype=torch.uint8)
    try:
        pages[start : stop : mmap.PAGESIZE] |= 0
    finally:
        del pages
