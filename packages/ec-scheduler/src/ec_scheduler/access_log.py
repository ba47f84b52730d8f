"""The opt-in access log: one line per item a consumer's scheduler counts, for sizing.

Runs in the scheduler process. `ec_access_log` (a path) turns it on; the
sizing tool (`ec_scheduler.sizing`, the `ec-cpu-sizing` command) replays the
file through the real allocator and policy at other region sizes.

The format (what each field means) is `ec_scheduler.access_log_format`.

Guarantees:
  * off the hot path: `record` (the scheduler thread, under its lock) appends one
    tuple to a bounded in-memory queue and does nothing else (no I/O, no
    formatting, no hashing); a daemon thread digests, formats and writes;
  * bounded memory: at most `buffer_records` records wait; past that a record is
    dropped and counted (`dropped`); the writer warns, rate-limited, writes the
    total so far into the file (`dropped_line`), and `close` warns of the final
    total if a warning held it back;
  * bounded disk: the file never exceeds `max_bytes`; a record that would cross
    it stops the log for good, with one warning (no rotation);
  * a write error (a full disk) stops the log with one warning and never reaches
    the scheduler: the engine serves on without it;
  * `close` has the writer write what is queued, flush and close the file
    (idempotent); it waits for that at most `close_timeout_s`, and a writer stuck
    on a stalled disk is left behind with a warning (it closes the file if its
    write ever returns): shutting the engine down never waits on the disk longer
    than that. It runs at the interpreter's exit too, should nobody call it;
  * the file is created owner-only (0600): an existing file at the path is
    replaced, never followed through a symbolic link.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ec_core._vllm import get_logger
from ec_core.ratelimit import RateLimitedWarnings
from ec_scheduler.access_log_format import (
    DIGEST_BYTES,
    dropped_line,
    header_lines,
    record_line,
)

logger = get_logger(__name__)

BUFFER_RECORDS = 65536
"""Records waiting for the writer at most: some 8-10 MiB of records, and the keys they
keep alive (7 MiB more with vLLM's 64-character content hashes as keys; a client's
longer multimodal UUIDs take more)."""
WRITE_INTERVAL_S = 0.25
"""How often the writer drains the queue."""
CLOSE_TIMEOUT_S = 10.0
"""How long `close` waits for the writer's last pass."""

_PERSON = b"ec-access-v1"

Record = tuple[float, str, int, int]
"""What the scheduler queues: monotonic time, tier key, rows, bytes."""


def log_path(path: Path, dp_index: int) -> Path:
    """The file an engine of data-parallel index `dp_index` writes: `path` itself for
    index 0, `<path>.dp<N>` otherwise (engines of one deployment share their config)."""
    return path if dp_index == 0 else path.with_name(f"{path.name}.dp{dp_index}")


def create_owner_only(path: Path) -> BinaryIO:
    """Create `path` afresh, readable and writable by this user only (0600).

    Whatever is at `path` (a file from an earlier run, a symbolic link) is removed
    first, and the file is created exclusively, so a link planted there is not followed.
    """
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "wb")


class AccessLog:
    """One scheduler's access log (see the module for the format and guarantees).

    `record` is called by the scheduler thread only; the file is the writer
    thread's from the start (it closes it on its way out), `close` never touches it.
    """

    def __init__(
        self,
        path: Path,
        max_bytes: int,
        *,
        block_bytes: int,
        buffer_records: int = BUFFER_RECORDS,
        interval_s: float = WRITE_INTERVAL_S,
        open_file: Callable[[Path], BinaryIO] | None = None,
        clock: Callable[[], float] = time.monotonic,
        digest_key: bytes | None = None,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        """Create the file, write its header and start the writer.

        `open_file` creates the file (default `create_owner_only`). `digest_key` keys
        the digests; None (what the scheduler passes) draws 16
        random bytes. A fixed one makes the file reproducible (a benchmark's
        trace written as a log for the docs), and must not be used for a real log.

        Raises OSError when the file cannot be created or the header not written
        (the caller runs without a log), and ValueError on a bound too small for
        the header.
        """
        self.path = path
        self.max_bytes = max_bytes
        self.dropped = 0
        """Records dropped because the queue was full (the scheduler thread counts)."""
        self.written = 0
        """Records written to the file."""
        self.on = True
        """False once the log stopped (its bound, a write error, `close`): `record` is a no-op."""
        self._queue: collections.deque[Record] = collections.deque()
        self._capacity = buffer_records
        self._clock = clock
        self._start = clock()
        self._key = digest_key if digest_key is not None else secrets.token_bytes(16)
        header = header_lines(block_bytes, datetime.datetime.now(datetime.UTC)).encode()
        if len(header) > max_bytes:
            raise ValueError(f"an access log bound of {max_bytes} bytes holds not even its header")
        self._file = (open_file or create_owner_only)(path)
        try:
            self._file.write(header)
            self._file.flush()
        except BaseException:
            self._file.close()
            raise
        self._size = len(header)
        self._warn = RateLimitedWarnings(logger).warn
        self._reported_drops = 0
        """The drop count the last warning logged gave."""
        self._warned_drops = 0
        """The drop count last handed to the rate-limited warning (logged or held back:
        it is handed a count once, so its held-back tally counts growths, not drains)."""
        self._written_drops = 0
        """The drop count the file last gave."""
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._close_timeout_s = close_timeout_s
        self._thread = threading.Thread(target=self._run, name="ec-access-log", daemon=True)
        self._thread.start()
        # An engine whose scheduler is never shut down (a process ending without its
        # engine's shutdown) still writes out what is queued: daemon threads are
        # stopped without notice once the interpreter exits.
        atexit.register(self.close)

    def record(self, key: str, rows: int, nbytes: int) -> None:
        """Queue one access (O(1)); dropped and counted when the queue is full.

        Only the scheduler thread appends, and the writer only takes, so the length
        checked here can only shrink before the append: the bound holds.
        """
        if self.on:
            queue = self._queue
            if len(queue) < self._capacity:
                queue.append((self._clock(), key, rows, nbytes))
            else:
                self.dropped += 1

    def digest(self, key: str) -> str:
        """The hex digest that stands for `key` in this log (see the module)."""
        return hashlib.blake2b(
            key.encode("utf-8", "surrogatepass"),
            key=self._key,
            digest_size=DIGEST_BYTES,
            person=_PERSON,
        ).hexdigest()

    def _run(self) -> None:
        stop = self._stop
        try:
            while not stop.wait(self._interval_s):
                self._drain()
            self._drain()
        except Exception as exc:  # a bug here must cost the log, never the engine
            self._stop_logging(
                "EC CPU tier: the access log's writer failed (%r); the log is off from now on",
                exc,
            )
        finally:
            self.on = False
            try:
                self._file.close()
            except Exception as exc:  # flushing what was left: a full disk, say
                logger.warning("EC CPU tier: closing the access log %s failed (%s)", self.path, exc)

    def _drain(self) -> None:
        """Write what is queued, and the drop count if it grew (the writer thread
        only: its last pass runs once `close` has set the stop flag)."""
        dropped = self.dropped
        if dropped > self._warned_drops:
            self._warned_drops = dropped
            if self._warn(
                "dropped",
                "EC CPU tier: the access log's queue was full; %d records dropped so far "
                "(the log is incomplete: its writer cannot keep up with %s)",
                dropped,
                self.path,
            ):
                self._reported_drops = dropped
        queue = self._queue
        says_drops = dropped > self._written_drops
        if not self.on or not (queue or says_drops):
            return
        lines: list[bytes] = []
        size = self._size
        start = self._start
        full = False
        if says_drops:
            line = dropped_line(dropped).encode()
            if size + len(line) > self.max_bytes:
                says_drops, full = False, True  # nothing more fits: the log stops below
            else:
                lines.append(line)
                size += len(line)
        while queue and not full:
            when, key, rows, nbytes = queue.popleft()
            line = record_line(when - start, self.digest(key), rows, nbytes).encode()
            if size + len(line) > self.max_bytes:
                full = True
                break
            lines.append(line)
            size += len(line)
        try:
            self._file.writelines(lines)
            self._file.flush()
        except OSError as exc:
            self._stop_logging(
                "EC CPU tier: writing the access log %s failed (%s); the log is off from "
                "now on, the engine serves on",
                self.path,
                exc,
            )
            return
        self._size = size
        self.written += len(lines)
        if says_drops:
            self._written_drops = dropped
            self.written -= 1  # the comment line is not a record
        if full:
            self._stop_logging(
                "EC CPU tier: the access log %s reached ec_access_log_max_bytes (%d bytes); "
                "later accesses are not logged",
                self.path,
                self.max_bytes,
            )

    def _stop_logging(self, message: str, *args: object) -> None:
        self.on = False
        self._queue.clear()
        logger.warning(message, *args)

    def close(self) -> None:
        """Have the writer write what is queued, flush and close the file, waiting at
        most `close_timeout_s` (see the module); idempotent. Records after this are
        ignored."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self.close)
        self._thread.join(timeout=self._close_timeout_s)
        if self._thread.is_alive():
            self.on = False
            logger.warning(
                "EC CPU tier: the access log's writer has been stuck writing %s for %.0f s; "
                "the engine shuts down without it (the file is closed if the write returns)",
                self.path,
                self._close_timeout_s,
            )
            return
        if self.dropped > self._reported_drops:
            logger.warning(
                "EC CPU tier: the access log %s lacks %d records in all (its queue was full)",
                self.path,
                self.dropped,
            )


def open_access_log(
    path: Path, max_bytes: int, *, block_bytes: int, dp_index: int
) -> AccessLog | None:
    """The engine's access log at `log_path(path, dp_index)`, or None with a warning
    when it cannot be created (the engine runs without it)."""
    target = log_path(path, dp_index)
    try:
        return AccessLog(target, max_bytes, block_bytes=block_bytes)
    except (OSError, ValueError) as exc:
        logger.warning(
            "EC CPU tier: cannot create the access log %s (%s); running without it", target, exc
        )
        return None


__all__ = [
    "AccessLog",
    "create_owner_only",
    "log_path",
    "open_access_log",
]
