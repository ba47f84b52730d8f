"""The CUDA driver calls the GPU checks need beyond torch: one contiguous copy and a batched copy.

* `contiguous_copy()`: one `cuMemcpyAsync` of a whole buffer on the current
  stream, the reference the checks' throughput rows compare against.
* `batch_op()`: a `swap_blocks_batch`-shaped callable over the driver's
  `cuMemcpyBatchAsync`, for GPU hosts without vLLM: the CUDA backend's own
  batched op is vLLM's `swap_blocks_batch`, which a torch-only host lacks, so
  the check hands this one to the real `TorchCudaRuntime` (and says so in
  its table). It is not used by the backend in an engine.

The driver library is the one torch already loaded (`libcuda.so.1`). Both
return None when the driver is missing or too old (`cuMemcpyBatchAsync` needs
a 12.8 driver). The unversioned `cuMemcpyBatchAsync` symbol keeps its 12.8
signature (with `failIdx`) on 13.x drivers, which export the 13.x form as
`cuMemcpyBatchAsync_v2`; this binds the unversioned one.

Tools only (the checks); nothing in the packages imports it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

SRC_ORDER_STREAM = 0x1
"""CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: read the source in stream order."""
SRC_ORDER_ANY = 0x3
"""CU_MEMCPY_SRC_ACCESS_ORDER_ANY: the source may be read at any time after the call."""
BATCH_MIN_DRIVER = 12080


class MemLocation(ctypes.Structure):
    """`CUmemLocation`: a location hint (ignored for memory not managed by CUDA)."""

    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class MemcpyAttributes(ctypes.Structure):
    """`CUmemcpyAttributes` as declared in cuda.h (12.8 and 13.x)."""

    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    )


class CudaDriverError(RuntimeError):
    """A driver call returned a non-zero CUresult."""


def _load() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def driver_version(lib: ctypes.CDLL) -> int:
    version = ctypes.c_int(0)
    code = lib.cuDriverGetVersion(ctypes.byref(version))
    if code != 0:
        raise CudaDriverError(f"cuDriverGetVersion returned {code}")
    return int(version.value)


def _stream() -> int:
    return int(torch.cuda.current_stream().cuda_stream)


def contiguous_copy() -> Callable[[int, int, int], None] | None:
    """`copy(dst, src, nbytes)`: one cuMemcpyAsync on torch's current stream, or None."""
    lib = _load()
    if lib is None or not hasattr(lib, "cuMemcpyAsync"):
        return None
    function = lib.cuMemcpyAsync
    function.argtypes = (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
    function.restype = ctypes.c_int

    def copy(dst: int, src: int, nbytes: int) -> None:
        code = function(dst, src, nbytes, _stream())
        if code != 0:
            raise CudaDriverError(f"cuMemcpyAsync returned {code}")

    return copy


def batch_op() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None] | None:
    """`op(src, dst, sizes, any_order)` over cuMemcpyBatchAsync, or None.

    Same contract as vLLM's `swap_blocks_batch`: three int64 CPU tensors of
    addresses and sizes; one batch on torch's current stream; `any_order`
    lets the driver read the sources at any time after the call.
    """
    lib = _load()
    if lib is None or not hasattr(lib, "cuMemcpyBatchAsync"):
        return None
    if driver_version(lib) < BATCH_MIN_DRIVER:
        return None
    function = lib.cuMemcpyBatchAsync
    function.argtypes = (
        ctypes.c_void_p,  # CUdeviceptr* dsts
        ctypes.c_void_p,  # CUdeviceptr* srcs
        ctypes.c_void_p,  # size_t* sizes
        ctypes.c_size_t,  # count
        ctypes.POINTER(MemcpyAttributes),
        ctypes.POINTER(ctypes.c_size_t),  # attrsIdxs
        ctypes.c_size_t,  # numAttrs
        ctypes.POINTER(ctypes.c_size_t),  # failIdx
        ctypes.c_void_p,  # CUstream
    )
    function.restype = ctypes.c_int

    def op(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, any_order: bool) -> None:
        count = int(sizes.numel())
        if count == 0:
            return
        for tensor in (src, dst, sizes):
            if tensor.dtype != torch.int64 or tensor.device.type != "cpu":
                raise ValueError("batch_op takes int64 CPU tensors")
        attributes = MemcpyAttributes()
        attributes.srcAccessOrder = SRC_ORDER_ANY if any_order else SRC_ORDER_STREAM
        first = ctypes.c_size_t(0)
        failed = ctypes.c_size_t(~0 & (2**64 - 1))
        code = function(
            dst.data_ptr(),
            src.data_ptr(),
            sizes.data_ptr(),
            count,
            ctypes.byref(attributes),
            ctypes.byref(first),
            1,
            ctypes.byref(failed),
            _stream(),
        )
        if code != 0:
            raise CudaDriverError(
                f"cuMemcpyBatchAsync returned {code} (failed copy index {failed.value})"
            )

    return op
