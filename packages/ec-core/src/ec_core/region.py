"""The shared host region: one memory-mapped file per engine and DP rank.

Every process of one engine maps the same file and sees the same bytes. The
file starts with one header page (magic, geometry, owner digest) followed by
`num_blocks` blocks of `block_size_bytes` each; `blocks` is a zero-copy int8
tensor over the block area.

Liveness protocol (how a live owner is told from a dead one):

* Each process that maps a region holds a shared `flock` on its file for as
  long as the mapping is open. The kernel drops the lock when the process
  dies, however it dies (SIGKILL included).
* Opening, creating and reclaiming are serialised by an exclusive `flock` on
  the region directory itself, held only for the duration of the open.
* So, under the directory lock, a region file on which an exclusive lock can
  be taken has no live process left: it is stale and is removed. A file that
  is being created is never seen half-made, because its creator takes its
  shared lock, sizes it and pre-faults it before releasing the directory lock.

No device pinning happens here: registering the mapping with a device is a
worker hook.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import re
import stat
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import torch

from ec_core._vllm import get_logger
from ec_core.settings import DEFAULT_OPEN_TIMEOUT_S, DEFAULT_REGION_DIR, KEY_CPU_BYTES
from ec_core.sizes import format_bytes

logger = get_logger(__name__)

FILE_PREFIX = "ec_cpu_tier_"
FILE_SUFFIX = ".mmap"
HEADER_BYTES = max(mmap.PAGESIZE, 4096)
"""The block area starts one page into the file, so blocks stay page aligned."""

_MAGIC = b"ECCPUREG"
_FORMAT_VERSION = 1
# magic, version, header bytes, block size, block count, owner digest
_HEADER = struct.Struct("<8sIIQQ32s")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
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


class ECSharedRegion:
    """A mapping of one engine's region file, created or joined on construction.

    `engine_id` names the region (the seed's `<instance_id>_dp<rank>`);
    `owner` is any further token that must match for two processes to share
    it (the connector passes the EC transfer config's engine id), so engines
    that happen to share an `engine_id` still get distinct files.

    Guarantees after construction:
      * `blocks` is an int8 tensor of shape `(num_blocks, block_size_bytes)`
        viewing the shared pages, and `base_address` is its first byte;
      * the file is a regular file of this user, mode 0600, exactly the size
        the geometry needs, whose header matches this geometry and owner;
      * this process holds a shared lock on it until `cleanup()`.

    The first process to open a region creates it (`is_creator`), reserves its
    pages (so a full directory fails here, not as a SIGBUS later) and
    pre-faults them. `cleanup()` is idempotent: every process unmaps; the
    creator also removes the file.
    """

    def __init__(
        self,
        engine_id: str,
        num_blocks: int,
        block_size_bytes: int,
        *,
        directory: Path | str = DEFAULT_REGION_DIR,
        open_timeout_s: float = DEFAULT_OPEN_TIMEOUT_S,
        owner: str = "",
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a region needs at least one block, got num_blocks={num_blocks}")
        if block_size_bytes <= 0:
            raise ValueError(f"block_size_bytes must be positive, got {block_size_bytes}")
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        self.block_size_bytes = block_size_bytes
        self.nbytes = num_blocks * block_size_bytes
        self.file_bytes = HEADER_BYTES + self.nbytes
        self.directory = Path(directory).absolute()
        self._digest = owner_digest(engine_id, owner, num_blocks, block_size_bytes)
        self.name = region_file_name(engine_id, self._digest)
        self.path = self.directory / self.name
        self.is_creator = False
        self._fd: int | None = None
        self._mmap: mmap.mmap | None = None
        self._blocks: torch.Tensor | None = None
        self._closed = False

        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with _exclusive_flock(
                dir_fd, open_timeout_s, what=f"region directory {self.directory}"
            ):
                try:
                    _reclaim_stale_regions(dir_fd, self.directory)
                    self._open_or_create(dir_fd)
                except BaseException:
                    # Undone while the directory lock is still held: a process
                    # waiting for it must never find the half-made file.
                    self._abort()
                    raise
        finally:
            os.close(dir_fd)

    # ------------------------------------------------------------------ open

    def _open_or_create(self, dir_fd: int) -> None:
        fd = self._open_existing(dir_fd)
        if fd is None:
            self._check_free_space(dir_fd)
            fd = os.open(
                self.name,
                os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
            self.is_creator = True
        self._fd = fd
        # Held until cleanup(); the kernel releases it if this process dies.
        # Nobody else can hold LOCK_EX here: only the stale-region sweep takes
        # it, and that runs under the directory lock we hold.
        fcntl.flock(fd, fcntl.LOCK_SH)
        if self.is_creator:
            self._initialise(fd)
        else:
            self._verify(fd)
        self._mmap = mmap.mmap(
            fd, self.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
        )
        if self.is_creator:
            self._prefault()
        self._blocks = torch.frombuffer(
            self._mmap, dtype=torch.int8, count=self.nbytes, offset=HEADER_BYTES
        ).view(self.num_blocks, self.block_size_bytes)
        logger.info(
            "%s EC CPU region %s: %d blocks x %d bytes (%s)",
            "Created" if self.is_creator else "Joined",
            self.path,
            self.num_blocks,
            self.block_size_bytes,
            format_bytes(self.nbytes),
        )

    def _open_existing(self, dir_fd: int) -> int | None:
        """Open the live region file of this name, or return None if absent."""
        try:
            fd = os.open(self.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RegionError(f"refusing to open {self.path}: it is a symbolic link") from exc
            raise RegionError(f"cannot open existing region {self.path}: {exc}") from exc
        try:
            _check_owned_regular_file(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_free_space(self, dir_fd: int) -> None:
        st = os.fstatvfs(dir_fd)
        free = st.f_bavail * st.f_frsize
        if self.file_bytes > free:
            raise ValueError(
                f"ec_connector_extra_config[{KEY_CPU_BYTES!r}] asks for {self.nbytes} bytes "
                f"({format_bytes(self.nbytes)}) but {self.directory} has only "
                f"{format_bytes(free)} free; lower it or point ec_cpu_dir elsewhere"
            )

    def _initialise(self, fd: int) -> None:
        os.ftruncate(fd, self.file_bytes)
        try:
            # Reserve every page now: on tmpfs this fails with ENOSPC instead of
            # letting a later write fault with SIGBUS.
            os.posix_fallocate(fd, 0, self.file_bytes)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
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
        header = _HEADER.pack(
            _MAGIC,
            _FORMAT_VERSION,
            HEADER_BYTES,
            self.block_size_bytes,
            self.num_blocks,
            bytes.fromhex(self._digest),
        )
        os.pwrite(fd, header, 0)

    def _verify(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        if size != self.file_bytes:
            raise RegionError(
                f"region {self.path} is {size} bytes but this engine's geometry needs "
                f"{self.file_bytes}; it belongs to another engine configuration"
            )
        raw = os.pread(fd, _HEADER.size, 0)
        if len(raw) != _HEADER.size:
            raise RegionError(f"region {self.path} has a truncated header")
        magic, version, header_bytes, block_size, num_blocks, digest = _HEADER.unpack(raw)
        expected = (_MAGIC, _FORMAT_VERSION, HEADER_BYTES, self.block_size_bytes, self.num_blocks)
        if (
            magic,
            version,
            header_bytes,
            block_size,
            num_blocks,
        ) != expected or digest.hex() != self._digest:
            raise RegionError(
                f"region {self.path} was made by another engine or format "
                f"(magic={magic!r}, version={version}, block_size={block_size}, "
                f"num_blocks={num_blocks}); refusing to share it"
            )

    def _prefault(self) -> None:
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
            _touch_pages(self._mmap)
            return
        _populate_write(self._mmap, 0, self.file_bytes)

    # ------------------------------------------------------------ accessors

    @property
    def blocks(self) -> torch.Tensor:
        """The `(num_blocks, block_size_bytes)` int8 view of the shared pages."""
        if self._blocks is None:
            raise RegionError(f"region {self.path} is closed")
        return self._blocks

    @property
    def base_address(self) -> int:
        """The virtual address of block 0 in this process."""
        return int(self.blocks.data_ptr())

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ECSharedRegion:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("creator" if self.is_creator else "joined")
        return f"ECSharedRegion({self.path}, {self.num_blocks}x{self.block_size_bytes}, {state})"

    # ------------------------------------------------------------- cleanup

    def cleanup(self) -> None:
        """Unmap, release the lock and, for the creator, remove the file.

        Idempotent and never raises: failures are logged as warnings. Another
        process that still maps the file keeps working (POSIX keeps the pages
        until the last mapping goes).
        """
        if self._closed:
            return
        self._closed = True
        if self.is_creator:
            self._unlink_if_ours()
        self._release_mapping()

    def _unlink_if_ours(self) -> None:
        fd = self._fd
        try:
            current = os.stat(self.path, follow_symlinks=False)
            if fd is not None:
                mine = os.fstat(fd)
                if (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
                    logger.warning(
                        "Not removing %s: it is no longer this engine's region", self.path
                    )
                    return
            os.unlink(self.path)
            logger.info("Removed EC CPU region %s", self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("Could not remove EC CPU region %s: %s", self.path, exc)

    def _release_mapping(self) -> None:
        self._blocks = None
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            # torch.frombuffer keeps a reference to the mmap object but no
            # buffer export, so mmap.close() would succeed and leave any live
            # tensor view dangling. Unmap now only if nothing else refers to
            # the mapping; otherwise the last view's release unmaps it.
            if sys.getrefcount(mapping) > 2:
                logger.warning(
                    "EC CPU region %s is still viewed by live tensors; it is unmapped "
                    "when they are freed",
                    self.path,
                )
            else:
                try:
                    mapping.close()
                except (BufferError, OSError) as exc:
                    logger.warning("Could not unmap EC CPU region %s: %s", self.path, exc)
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError as exc:
                logger.warning("Could not close EC CPU region %s: %s", self.path, exc)
            self._fd = None

    def _abort(self) -> None:
        """Undo a failed construction: never leave a half-made file behind."""
        self._closed = True
        if self.is_creator:
            self._unlink_if_ours()
        self._release_mapping()


# ---------------------------------------------------------------- helpers


@contextmanager
def _exclusive_flock(fd: int, timeout_s: float, *, what: str) -> Iterator[None]:
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


def _populate_write(mapping: mmap.mmap, start: int, length: int) -> None:
    """Fault in `[start, start + length)` writable, in one system call."""
    mapping.madvise(_MADV_POPULATE_WRITE, start, length)


def _touch_pages(mapping: mmap.mmap) -> None:
    """Fault in every page by rewriting its first byte with its own value.

    Read-modify-write keeps existing bytes (the header). Only the creator calls
    this, before any other process can map the file (it holds the directory
    lock), so nothing races the rewrite.
    """
    pages = torch.frombuffer(mapping, dtype=torch.uint8)
    try:
        pages[:: mmap.PAGESIZE] |= 0
    finally:
        del pages


def _check_owned_regular_file(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"refusing to use {path}: not a regular file")
    if st.st_uid != os.geteuid():
        raise RegionError(f"refusing to use {path}: owned by uid {st.st_uid}, not this user")
    if st.st_mode & 0o077:
        raise RegionError(f"refusing to use {path}: mode {stat.S_IMODE(st.st_mode):o} is not 0600")


def _reclaim_stale_regions(dir_fd: int, directory: Path) -> None:
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
