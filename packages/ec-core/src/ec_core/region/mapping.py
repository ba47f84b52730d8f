"""ECSharedRegion: one engine's region file, created or joined, and mapped.

Runs in worker processes (and in test tools that check the bytes); the
scheduler only needs the geometry (`ec_core.layout`). The file starts with one
header page (magic, geometry, owner digest) followed by `num_blocks` blocks of
`block_size_bytes` each; `blocks` is a zero-copy int8 tensor over the block
area. How live owners are told from dead ones is in `ec_core.region.files`.
No device pinning happens here: registering the mapping with a device is a
worker hook.

How the creator reserves the pages (up front, or the front first and the rest
in a background thread with `background_reserve`) is `ec_core.region.page_reserver`.
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
from ec_core.region.page_reserver import PageReserver
from ec_core.region.reservation import Reservation, ReservationState, write_record
from ec_core.settings import DEFAULT_OPEN_TIMEOUT_S, DEFAULT_REGION_DIR, KEY_CPU_BYTES
from ec_core.sizes import format_bytes

logger = get_logger(__name__)


class ECSharedRegion(PageReserver):
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

    The first process to open a region creates it (`is_creator`) and
    reserves and pre-faults its pages (a directory that cannot hold them
    fails here, not as a SIGBUS later): all of them before the constructor
    returns, or, with `background_reserve`, the first `SYNC_RESERVE_BYTES`
    and the rest from the front in a background thread. Only blocks below
    `reserved_blocks` may be written (the watermark's guarantee is stated in
    `ec_core.region.reservation`). If the directory fills up partway, the
    reservation stops there with a warning and the region stays usable up to
    that watermark. Use `background_reserve` only where nothing registers
    (pins) the whole mapping up front: pinning faults in every page, beyond
    the watermark too. Pages are reserved synchronously anyway where the
    directory supports neither fallocate nor `MADV_POPULATE_WRITE` (touching
    pages is the only way left, and on a full tmpfs that is a SIGBUS).
    `cleanup()` is idempotent: the creator removes the file first, then the
    reservation stops and every process unmaps. `remove_file()` removes the
    file alone, before anything a shutdown may wait for.
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
        background_reserve: bool = False,
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
        self._file_removed = False
        self._init_reservation(background_reserve)

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
            # Exactly 0600 whatever the umask: this engine's other ranks (the same
            # user) must open it read-write, and nobody else may open it at all.
            os.fchmod(fd, 0o600)
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
        if self.is_creator:
            self._start_reservation(self._blocks.data_ptr() - HEADER_BYTES)
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
        if st.f_blocks == 0:
            # A file system without a size (ramfs, a tmpfs mounted with size=0)
            # reports 0 blocks and 0 free: it is bounded by memory alone, so the
            # region is held against the host's memory. (Below that, pages it
            # cannot get end in the kernel's out-of-memory handling, not ENOSPC.)
            free = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            where = f"{self.directory} has no size limit and the host has"
        else:
            free = st.f_bavail * st.f_frsize
            where = f"{self.directory} has only"
        if self.file_bytes > free:
            raise ValueError(
                f"ec_connector_extra_config[{KEY_CPU_BYTES!r}] asks for {self.nbytes} bytes "
                f"({format_bytes(self.nbytes)}) but {where} {format_bytes(free)} "
                "free; lower it or point ec_cpu_dir elsewhere"
            )

    def _initialise(self, fd: int) -> None:
        os.ftruncate(fd, self.file_bytes)
        self._reserve_front(fd)
        header = pack_header(self.block_size_bytes, self.num_blocks, self._digest)
        os.pwrite(fd, header, 0)
        write_record(fd, Reservation(0, ReservationState.RUNNING))

    def _verify(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        if size != self.file_bytes:
            raise RegionError(
                f"region {self.path} is {size} bytes but this engine's geometry needs "
                f"{self.file_bytes}; it belongs to another engine configuration"
            )
        raw = os.pread(fd, HEADER.size, 0)
        check_header(raw, self.path, self.block_size_bytes, self.num_blocks, self._digest)

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
        """For the creator, remove the file; then unmap and release the lock.

        Idempotent and never raises: failures are logged as warnings. Another
        process that still maps the file keeps working (POSIX keeps the pages
        until the last mapping goes). The file goes before the wait for the
        background reservation (see `remove_file`).
        """
        if self._closed:
            return
        self._closed = True
        self.remove_file()
        if self._stop_reservation():
            self._release_mapping()

    def remove_file(self) -> None:
        """For the creator, remove the region's file now; the mapping stays until `cleanup()`.

        Idempotent and never raises. Copies in flight, the background
        reservation and other processes that map the file keep working (the
        pages live while a mapping or descriptor does). A shutdown calls this
        before anything it may wait for: vLLM SIGKILLs an engine's processes
        that are still shutting down 5 s after asking them to stop, and a file
        left then holds its pages until the next engine starts in this
        directory (which sweeps it).
        """
        if self.is_creator and not self._file_removed:
            self._file_removed = True
            self._unlink_if_ours()

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
        self.remove_file()
        if self._stop_reservation():
            self._release_mapping()
