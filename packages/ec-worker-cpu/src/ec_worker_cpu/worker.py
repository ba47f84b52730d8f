"""CpuECCPUWorker: the worker hooks for vLLM's CPU platform.

Encoder outputs are host tensors, so a copy is a plain `memcpy` between the
region and the encoder cache: no pinning, no streams, and every batch has
landed when `_submit_transfer` returns.

A loaded entry is copied into a buffer of its own that vLLM then owns. Fresh
memory faults on every page the copy touches, which costs about as much as
the copy itself (far more on some virtual machines). glibc reuses warm heap
memory below 32 MiB, but maps every larger allocation fresh, so large loads
land in `LoadBufferPool` buffers: recycled only after vLLM has let go of every
tensor over them, and pre-faulted when they must be fresh.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import mmap
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ec_core.worker_process.transfer import (
    CompletedTransfer,
    DescriptorBatch,
    TransferDirection,
    TransferHandle,
)
from ec_core.worker_process.worker import ECCPUWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from ec_core.layout import RegionLayout
    from ec_core.worker_process.ranks import RankInfo

_memmove = ctypes.memmove
_perf_counter = time.perf_counter
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
_PAGE = mmap.PAGESIZE
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PREFAULT_MIN_BYTES = 32 << 20
"""From this size on glibc serves every allocation with a fresh mapping (32 MiB
is the cap of its dynamic mmap threshold), which faults on every page; smaller
ones usually reuse warm heap memory of an entry freed before. So a fresh pooled
buffer this large is pre-faulted."""

_POOL_MIN_BYTES = 1 << 20
"""Loads from this size on are pooled. Below 32 MiB glibc serves an allocation from a
fresh mapping or from heap it may have just trimmed, depending on its dynamic
thresholds; either way every page faults. A step that loads 16 entries of 1 MiB
ran at 2-16 GB/s unpooled and 15-19 GB/s pooled (`hatch run bench-copy`, 16x1MB
rows). Pooling costs about 4 us a load more than `torch.empty`, which smaller
entries would not win back."""


@functools.lru_cache(maxsize=1024)
def _size_class(nbytes: int) -> int:
    """The buffer size `nbytes` is served from: whole pages, at most 1/8 above `nbytes`
    (so entries of nearly the same size share buffers). Cached: a model's entries come
    in few sizes, and a load asks once per entry."""
    pages = -(-nbytes // _PAGE)
    if pages > 16:
        step = 1 << (pages.bit_length() - 4)
        pages = -(-pages // step) * step
    return pages * _PAGE


def _prefault(buffer: torch.Tensor) -> None:
    """Back `buffer` with (huge) pages in two system calls instead of one fault per page.

    Fresh memory costs a page fault every 4 KiB on its first write; for large
    buffers that, not the copy, is the cost. Both advices are hints: where the
    kernel refuses them, the copy just faults as usual.
    """
    start = (buffer.data_ptr() + _PAGE - 1) & ~(_PAGE - 1)
    end = (buffer.data_ptr() + buffer.numel()) & ~(_PAGE - 1)
    if end > start:
        _libc.madvise(start, end - start, _MADV_HUGEPAGE)
        _libc.madvise(start, end - start, _MADV_POPULATE_WRITE)


_NUMPY_TWINS: dict[torch.dtype, type[np.generic]] = {
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
}
"""Torch dtypes numpy has too: `torch.from_numpy` gives them directly."""

_NUMPY_STAND_INS: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int16,
    4: np.int32,
    8: np.int64,
}
"""Per item size, the numpy dtype a tensor of a dtype numpy lacks (bfloat16, the
float8s) is built as and then viewed from (same bytes, same shape)."""


class _Buffer:
    """One pooled buffer: its memory (a uint8 tensor) and a numpy window on it.

    Each loan is a numpy array of its own over the window: it holds the window,
    which holds the memory, so a tensor handed out never depends on the pool (or
    this object) outliving it.
    """

    __slots__ = ("memory", "size", "window")

    def __init__(self, size: int) -> None:
        self.size = size
        self.memory = torch.empty(size, dtype=torch.uint8)
        if size >= _PREFAULT_MIN_BYTES:
            _prefault(self.memory)
        self.window = self.memory.numpy()


class LoadBufferPool:
    """Host buffers for loaded entries, recycled once nothing refers to them any more.

    Guarantees:
      * `take` returns a contiguous tensor in memory no live tensor shares:
        every tensor it hands out is built (`torch.from_numpy`) over a numpy
        array of its own, the tensor's storage holds that array, and a buffer
        comes back to the pool only when the array dies, that is when the
        storage (every view, slice or alias vLLM made of the entry) has been
        freed; until then the pool holds the buffer's memory alive;
      * at most `idle_limit` bytes wait in the pool between loads (the oldest
        idle buffers are freed first); a buffer that does not fit is freed as
        soon as its entry is;
      * a buffer freed on another thread, or while `take` runs, is only queued;
        it is never handed out twice and never waits on a lock;
      * after `close` nothing is kept: idle buffers are freed at once and lent
        ones when their entries are;
      * a fresh buffer that cannot be allocated (host memory exhausted) is tried
        once more after the idle buffers are freed.
    """

    def __init__(self, idle_limit: int, min_bytes: int = _POOL_MIN_BYTES) -> None:
        self.idle_limit = idle_limit
        self.min_bytes = min_bytes
        """Smaller requests are plain allocations (not pooled)."""
        self._free: dict[int, list[_Buffer]] = {}
        self._idle: collections.OrderedDict[_Buffer, None] = collections.OrderedDict()
        """Every idle buffer, oldest first (the `_free` lists hold the same ones by size)."""
        self._idle_bytes = 0
        self._lent: dict[int, tuple[weakref.ref[np.ndarray[Any, Any]], _Buffer]] = {}
        self._returned: collections.deque[_Buffer] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        self.fresh = 0
        """How many buffers had to be allocated (the rest were recycled)."""

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    @property
    def lent(self) -> int:
        """Buffers handed out whose tensors are still alive."""
        return len(self._lent)

    def take(
        self, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """A `dtype` tensor over `nbytes` bytes of memory of its own (contents undefined).

        It is 1-D, or of `shape` when given (whose elements must fill `nbytes`
        exactly): built in that shape, which costs less than viewing it after.
        """
        if shape is None:
            shape = (nbytes // dtype.itemsize,)
        twin = _NUMPY_TWINS.get(dtype)
        built_as = twin or _NUMPY_STAND_INS.get(dtype.itemsize)
        if nbytes < self.min_bytes or self._closed or built_as is None:
            return torch.empty(shape, dtype=dtype)  # (no numpy type of its size: not pooled)
        size = _size_class(nbytes)
        buffer = None
        with self._lock:
            if self._returned or self._idle_bytes > self.idle_limit:
                self._settle()
            stack = self._free.get(size)
            if stack:
                buffer = stack.pop()
                del self._idle[buffer]
                self._idle_bytes -= size
        if buffer is None:
            buffer = self._fresh(size)
            self.fresh += 1
        array = np.ndarray(shape, built_as, buffer.window)
        tensor = torch.from_numpy(array)  # its storage holds `array`, and nothing else does
        if twin is None:
            tensor = tensor.view(dtype)
        loan = weakref.ref(array, self._on_free)
        self._lent[id(loan)] = (loan, buffer)
        return tensor

    def _fresh(self, size: int) -> _Buffer:
        """A new buffer of `size`; when host memory runs out, the idle buffers are
        freed and it is tried once more (the memory they hold is what is missing, and
        the load would otherwise fail, its fallback included)."""
        try:
            return _Buffer(size)
        except (MemoryError, RuntimeError):  # torch's CPU allocator raises RuntimeError
            with self._lock:
                self._settle()  # buffers freed meanwhile count too
                if not self._idle_bytes:
                    raise
                self._drop_idle()
        return _Buffer(size)

    def _on_free(self, loan: weakref.ref[np.ndarray[Any, Any]]) -> None:
        """The storage over a lent buffer was freed (any thread, maybe inside `take`)."""
        entry = self._lent.pop(id(loan), None)
        if entry is None:
            return
        self._returned.append(entry[1])
        if self._closed:
            # Checked after queueing: a `close` on another thread may have cleared
            # the queue just before this buffer reached it.
            self._returned.clear()
            return
        if self._lock.acquire(blocking=False):
            try:
                self._settle()
            finally:
                self._lock.release()

    def _settle(self) -> None:
        """Move returned buffers to the idle lists and keep within `idle_limit` (lock held).

        After `close` it drops them instead: a closed pool keeps nothing."""
        if self._closed:
            self._returned.clear()
            return
        while self._returned:
            buffer = self._returned.popleft()
            if buffer.size > self.idle_limit:
                continue  # freed with its last reference
            self._free.setdefault(buffer.size, []).append(buffer)
            self._idle[buffer] = None
            self._idle_bytes += buffer.size
        while self._idle_bytes > self.idle_limit:
            buffer, _ = self._idle.popitem(last=False)
            self._free[buffer.size].remove(buffer)
            self._idle_bytes -= buffer.size

    def close(self) -> None:
        """Free the idle buffers and keep none that come back later. Idempotent."""
        with self._lock:
            self._closed = True
            self._returned.clear()
            self._drop_idle()

    def _drop_idle(self) -> None:
        """Forget every idle buffer (lock held): each is freed with its last reference."""
        self._free.clear()
        self._idle.clear()
        self._idle_bytes = 0


class CpuECCPUWorker(ECCPUWorker):
    """Synchronous host-memory copies; one `memcpy` per run of blocks.

    Entries of 1 MiB and more are loaded into recycled buffers
    (`LoadBufferPool`, pre-faulted when fresh from 32 MiB on); one is reused
    only after vLLM freed every tensor over it. Smaller ones get plain tensors.
    """

    load_pool_idle_bytes: ClassVar[int] = 256 << 20
    """How many bytes of freed load buffers may wait for reuse."""
    load_pool_min_bytes: ClassVar[int] = _POOL_MIN_BYTES
    """Entries from this size on are loaded into pooled buffers (see `_POOL_MIN_BYTES`)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        *,
        layout: RegionLayout | None = None,
        rank_info: RankInfo | None = None,
    ) -> None:
        self.load_pool = LoadBufferPool(self.load_pool_idle_bytes, self.load_pool_min_bytes)
        super().__init__(vllm_config, layout=layout, rank_info=rank_info)

    def _submit_transfer(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: Sequence[torch.Tensor],
    ) -> TransferHandle:
        began = _perf_counter()
        if len(batch.sizes) == 1:  # the usual step: one entry in one run
            _memmove(batch.dst[0], batch.src[0], batch.sizes[0])
        else:
            memmove = _memmove
            for src, dst, size in zip(batch.src, batch.dst, batch.sizes, strict=True):
                memmove(dst, src, size)
        return CompletedTransfer(_perf_counter() - began)

    def _new_device_buffer(self, nbytes: int) -> torch.Tensor:
        return self.load_pool.take(nbytes, torch.uint8)

    def _new_entry_buffer(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        rows, cols = shape
        return self.load_pool.take(rows * cols * dtype.itemsize, dtype, shape)

    def _shutdown_transfer_backend(self) -> None:
        self.load_pool.close()
