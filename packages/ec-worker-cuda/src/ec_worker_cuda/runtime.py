"""TorchCudaRuntime: every CUDA call of the CUDA backend, through torch.

The narrow adapter behind `StreamedECCPUWorker` (ec-core's `DeviceRuntime`):
streams and events are torch's; host registration goes through torch's CUDA
runtime bindings (`cudaHostRegister`/`cudaHostUnregister`; the error a failed
call leaves pending is read off the libcudart torch loaded); a batch of copies
is one call of vLLM's `swap_blocks_batch` (one `cuMemcpyBatchAsync` on CUDA >=
12.8, a loop of `cudaMemcpyAsync` inside the op on older CUDA) when the
installed vLLM has it, else one `copy_(non_blocking=True)` per block run.

Nothing here runs at import time; constructing the runtime needs CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable
from typing import Any

import torch

from ec_core.worker_process.transfer import DescriptorBatch, TransferDirection

BatchOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None]


class CudaRuntimeError(RuntimeError):
    """A CUDA runtime call returned an error code."""


def find_swap_blocks_batch() -> BatchOp | None:
    """vLLM's batched copy op, if the installed vLLM has it and its kernel is built."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    op = getattr(ops, "swap_blocks_batch", None)
    if op is None:
        return None
    try:
        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018  (is the kernel registered?)
    except (AttributeError, RuntimeError):
        return None
    return op  # type: ignore[no-any-return]


def _cudart() -> Any:
    """torch's CUDA runtime bindings (untyped in torch's stubs)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _loaded_libraries(prefix: str) -> list[ctypes.CDLL]:
    """Every shared library this process has already loaded whose file name starts
    with `prefix` (never loads one: `RTLD_NOLOAD`)."""
    paths: dict[str, None] = {}
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                path = fields[5].strip().removesuffix(" (deleted)")
                if os.path.basename(path).startswith(prefix):
                    paths[path] = None
    libraries = []
    for path in paths:
        with contextlib.suppress(OSError):
            libraries.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD))
    return libraries


def _clear_last_error() -> None:
    """Read (and so reset) the error a failed runtime call left pending on this thread.

    The CUDA runtime keeps the error of a failed call as the thread's last
    error until `cudaGetLastError` reads it, and torch checks every kernel
    launch with `cudaGetLastError`: left pending, a registration failure the
    worker survives would fail the model's next kernel. torch's `cudart()`
    bindings have no `cudaGetLastError`; the runtime torch loaded (libcudart,
    by file name; one instance per library file) does.
    """
    for library in _loaded_libraries("libcudart"):
        with contextlib.suppress(AttributeError):
            library.cudaGetLastError()


def _check(call: str, result: Any) -> None:
    code = int(getattr(result, "value", result))
    if code == 0:
        return
    _clear_last_error()
    name = ""
    with contextlib.suppress(Exception):
        name = str(_cudart().cudaGetErrorString(result))
    raise CudaRuntimeError(f"{call} returned CUDA error {code}{f' ({name})' if name else ''}")


class TorchCudaRuntime:
    """The CUDA implementation of `DeviceRuntime` (see the module docstring)."""

    name = "CUDA"
    max_batch_descriptors: int | None = None
    """cuMemcpyBatchAsync documents no per-call limit; set this if a driver refuses big batches."""

    def __init__(self, device: torch.device | None = None, batch_op: BatchOp | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaECCPUWorker needs a CUDA device, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); on a CPU host the platform's backend is "
                "ec-worker-cpu"
            )
        self.device = (
            device if device is not None else torch.device("cuda", torch.cuda.current_device())
        )
        self._batch_op = batch_op if batch_op is not None else find_swap_blocks_batch()

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def use_stream(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: torch.cuda.Stream, waitee: torch.cuda.Stream) -> None:
        waiter.wait_stream(waitee)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def synchronize_stream(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()

    def synchronize_device(self) -> None:
        torch.cuda.synchronize(self.device)

    def register_host(self, address: int, nbytes: int) -> None:
        _check("cudaHostRegister", _cudart().cudaHostRegister(address, nbytes, 0))

    def unregister_host(self, address: int) -> None:
        _check("cudaHostUnregister", _cudart().cudaHostUnregister(address))

    def has_batch_copy(self) -> bool:
        return self._batch_op is not None

    def batch_copy(self, batch: DescriptorBatch, direction: TransferDirection) -> object:
        assert self._batch_op is not None
        src, dst, sizes = batch.as_tensors()
        # A load's source is a ready region entry no stream writes: the DMA
        # engine may read it out of stream order. A save's source was just
        # written by the compute stream: keep stream order.
        self._batch_op(src, dst, sizes, direction is TransferDirection.HOST_TO_DEVICE)
        return (src, dst, sizes)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def device_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
