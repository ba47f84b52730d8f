"""CpuECCPUWorker: the worker hooks for vLLM's CPU platform.

Encoder outputs are host tensors, so a copy is a plain `memcpy` between the
region and the encoder cache: no pinning, no streams, and every batch has
landed when `_submit_transfer` returns.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from collections.abc import Sequence

import torch

from ec_core.worker_process.transfer import (
    CompletedTransfer,
    DescriptorBatch,
    TransferDirection,
    TransferHandle,
)
from ec_core.worker_process.worker import ECCPUWorker

_memmove = ctypes.memmove
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PREFAULT_MIN_BYTES = 32 << 20
"""From this size on a fresh load buffer is pre-faulted before the copy. glibc
serves every allocation this large with a fresh mapping (32 MiB is the cap of
its dynamic mmap threshold); smaller ones usually reuse warm heap memory."""


def _prefault(buffer: torch.Tensor) -> None:
    """Back `buffer` with (huge) pages in two system calls instead of one fault per page.

    A loaded entry lands in freshly allocated memory, where a plain copy pays a
    page fault every 4 KiB; for large entries that, not the copy, is the cost.
    Both advices are hints: where the kernel refuses them, the copy just
    faults as usual.
    """
    start = (buffer.data_ptr() + mmap.PAGESIZE - 1) & ~(mmap.PAGESIZE - 1)
    end = (buffer.data_ptr() + buffer.numel()) & ~(mmap.PAGESIZE - 1)
    if end > start:
        _libc.madvise(start, end - start, _MADV_HUGEPAGE)
        _libc.madvise(start, end - start, _MADV_POPULATE_WRITE)


class CpuECCPUWorker(ECCPUWorker):
    """Synchronous host-memory copies; one `memcpy` per run of blocks."""

    def _submit_transfer(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: Sequence[torch.Tensor],
    ) -> TransferHandle:
        began = time.perf_counter()
        for src, dst, size in batch:
            _memmove(dst, src, size)
        return CompletedTransfer(time.perf_counter() - began)

    def _new_device_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes >= _PREFAULT_MIN_BYTES:
            _prefault(buffer)
        return buffer
