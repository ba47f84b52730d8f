"""The region's files on disk: names, header, ownership, locks and the stale-file sweep.

Used by every process: the scheduler derives the file's name from the config;
worker processes create, verify and map it (`ec_core.region.mapping`), and so
does the scheduler process of an engine whose NIXL source serves peers.

Liveness protocol (how a live owner is told from a dead one):

* Each process that maps a region holds a shared `flock` on its file for as
  long as the mapping is open. The kernel drops the lock when the process
  dies, however it dies (SIGKILL included).
* Opening, creating and reclaiming are serialised by an exclusive `flock` on
  the region directory itself (`exclusive_flock`), held only for the
  duration of the open.
* So, under the directory lock, a region file on which an exclusive lock can
  be taken has no live process left: it is stale and is removed
  (`reclaim_stale_regions`).
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import re
import stat
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ec_core._vllm import get_logger
from ec_core.sizes import format_bytes

logger = get_logger(__name__)

FILE_PREFIX = "ec_cpu_tier_"
FILE_SUFFIX = ".mmap"
HEADER_BYTES = max(mmap.PAGESIZE, 4096)
"""The block area starts one page into the file, so blocks stay page aligned."""

MAGIC = b"ECCPUREG"
FORMAT_VERSION = 2
"""2: the header page also holds the reservation record (`ec_core.region.reservation`)."""
# magic, version, header bytes, block size, block count, owner digest
HEADER = struct.Struct("<8sIIQQ32s")
_SAFE_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
_MAX_ID_CHARS = 96
_LOCK_POLL_S = 0.005
_LOCK_POLL_MAX_S = 0.05


class RegionError(RuntimeError):
    """The region could not be opened or created; the message says why."""


def region_file_name(engine_id: str, digest: str) -> str:
    """The file name for a region: safe whatever `engine_id` contains.

    The readable part keeps only `[A-Za-z0-9_.-]` (no `/`, no leading dot,
    bounded length) so the name cannot leave its directory; the digest of the
    full identity keeps two different engines apart even when their readable
    parts coincide.
    """
    readable = _SAFE_CHARS.sub("_", engine_id).lstrip(".")[:_MAX_ID_CHARS] or "engine"
    return f"{FILE_PREFIX}{readable}_{digest[:16]}{FILE_SUFFIX}"


def owner_digest(engine_id: str, owner: str, num_blocks: int, block_size_bytes: int) -> str:
    """SHA-256 (hex) of everything that makes a region this engine's own."""
    text = "\0".join((engine_id, owner, str(num_blocks), str(block_size_bytes)))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def pack_header(block_size_bytes: int, num_blocks: int, digest: str) -> bytes:
    """The header page's fields for a region of this geometry and owner digest."""
    return HEADER.pack(
        MAGIC, FORMAT_VERSION, HEADER_BYTES, block_size_bytes, num_blocks, bytes.fromhex(digest)
    )


def check_header(
    raw: bytes, path: Path, block_size_bytes: int, num_blocks: int, digest: str
) -> None:
    """Raise RegionError unless `raw` is the header of this engine's region."""
    if len(raw) != HEADER.size:
        raise RegionError(f"region {path} has a truncated header")
    magic, version, header_bytes, block_size, blocks, owner = HEADER.unpack(raw)
    expected = (MAGIC, FORMAT_VERSION, HEADER_BYTES, block_size_bytes, num_blocks)
    if (magic, version, header_bytes, block_size, blocks) != expected or owner.hex() != digest:
        raise RegionError(
            f"region {path} was made by another engine or format "
            f"(magic={magic!r}, version={version}, block_size={block_size}, "
            f"num_blocks={blocks}); refusing to share it"
        )


@contextmanager
def exclusive_flock(fd: int, timeout_s: float, *, what: str) -> Iterator[None]:
    """Hold LOCK_EX on `fd`, waiting at most `timeout_s` for it."""
    deadline = time.monotonic() + timeout_s
    delay = _LOCK_POLL_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"waited {timeout_s:.0f} s for the lock on {what}; another process "
                    "is creating a region there or holds the lock (raise "
                    "ec_region_open_timeout_s if regions are very large)"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, _LOCK_POLL_MAX_S)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def check_owned_regular_file(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"refusing to use {path}: not a regular file")
    if st.st_uid != os.geteuid():
        raise RegionError(f"refusing to use {path}: owned by uid {st.st_uid}, not this user")
    if st.st_mode & 0o077:
        raise RegionError(f"refusing to use {path}: mode {stat.S_IMODE(st.st_mode):o} is not 0600")


def reclaim_stale_regions(dir_fd: int, directory: Path) -> None:
    """Remove region files of dead engines. Caller holds the directory lock.

    A file is stale when no process holds its shared lock. Only regular files
    of this user with our prefix and suffix are considered; symbolic links and
    anything else are left alone.
    """
    for name in os.listdir(dir_fd):
        if not (name.startswith(FILE_PREFIX) and name.endswith(FILE_SUFFIX)):
            continue
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd
            )
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live engine maps it
            current = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (current.st_dev, current.st_ino) != (st.st_dev, st.st_ino):
                continue
            os.unlink(name, dir_fd=dir_fd)
            logger.warning(
                "Removed stale EC CPU region %s (%s) left by an engine that died",
                directory / name,
                format_bytes(st.st_size),
            )
        except OSError as exc:
            logger.warning("Could not inspect possible stale region %s: %s", directory / name, exc)
        finally:
            os.close(fd)
