"""ECSharedRegion: one engine's region file, created or joined, and mapped.

Runs in worker processes (and in test tools that check the bytes); the
scheduler only needs the geometry (`ec_core.layout`). The file starts with one
header page (magic, geometry, owner digest) followed by `num_blocks` blocks of
`block_size_bytes` each; `blocks` is a zero-copy int8 tensor over the block
area. How live owners are told from dead ones is in `ec_core.region.files`.
No device pinning happens here: registering the mapping with a device is a
worker hook.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import sys
from pathlib import Path
from types import TracebackType

import torch

from ec_core._vllm import get_logger
from ec_core.region.files import (
    HEADER,
    HEADER_BYTES,
    RegionError,
    check_header,
    check_owned_regular_file,
    exclusive_flock,
    owner_digest,
    pack_header,
    reclaim_stale_regions,
    region_file_name,
)
from ec_core.settings import DEFAULT_OPEN_TIMEOUT_S, DEFAULT_REGION_DIR, KEY_CPU_BYTES
from ec_core.sizes import format_bytes

logger = get_logger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class ECSharedRegion:
    """A mapping of one engine's region file, created or joined on construction.

    `engine_id` names the region (`<instance_id>_dp<rank>`, see `ec_core.layout`);
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
            with exclusive_flock(dir_fd, open_timeout_s, what=f"region directory {self.directory}"):
                try:
                    reclaim_stale_regions(dir_fd, self.directory)
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
            check_owned_regular_file(fd, self.path)
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
        header = pack_header(self.block_size_bytes, self.num_blocks, self._digest)
        os.pwrite(fd, header, 0)

    def _verify(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        if size != self.file_bytes:
            raise RegionError(
                f"region {self.path} is {size} bytes but this engine's geometry needs "
                f"{self.file_bytes}; it belongs to another engine configuration"
            )
        raw = os.pread(fd, HEADER.size, 0)
        check_header(raw, self.path, self.block_size_bytes, self.num_blocks, self._digest)

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
