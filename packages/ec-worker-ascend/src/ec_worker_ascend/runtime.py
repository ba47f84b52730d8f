"""NpuRuntime: every Ascend call of the Ascend backend.

The narrow adapter behind `StreamedECCPUWorker` (ec-core's `DeviceRuntime`)
for vLLM on Ascend NPUs. Streams and events are `torch.npu`'s (torch_npu).
`torch_npu` is imported only when a runtime is built — in a worker process —
never when this module is imported.

Host registration (pinning the region mapping), first available of:
  1. torch_npu >= 2.13: `torch.npu.npurt().npuHostRegister(ptr, size,
     ACL_HOST_REG_PINNED)` / `npuHostUnregister`;
  2. CANN >= 8.5 through ctypes: `aclrtHostRegisterV2` / `aclrtHostUnregister`
     in libascendcl.so.
Neither → `register_host` raises naming both; the worker then warns once and
copies from pageable memory (see the package README for why it falls back
instead of refusing to start).

Batched copies, first available of:
  1. the batched op of the installed vllm-ascend,
     `torch.ops._C_ascend.swap_blocks_batch` (its 4-argument form takes a
     direction: 0 host→device, 1 device→host; a 3-argument form is called
     without it);
  2. `aclrtMemcpyBatchAsync` through ctypes;
  3. none: the worker issues one async copy per block run.
Batches are split at 4096 descriptors (the limit Mooncake found for CANN's
batched memcpy). A batched call that answers ACL_ERROR_RT_FEATURE_NOT_SUPPORT
(207000) is not tried again; that chunk is copied with `aclrtMemcpyAsync`.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ec_core.worker_process.transfer import DescriptorBatch, TransferDirection

ACL_HOST_REG_PINNED = 0x10000000
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEM_LOCATION_TYPE_HOST = 0
ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
MAX_BATCH_DESCRIPTORS = 4096
REGISTRATION_REQUIREMENT = (
    "torch_npu >= 2.13 (torch.npu.npurt().npuHostRegister) or CANN >= 8.5 "
    "(aclrtHostRegisterV2 in libascendcl.so)"
)
ACL_ERROR_NAMES = {
    107000: "invalid parameter",
    207000: "feature not supported",
    507899: "driver error (host range not page aligned?)",
}


class AclError(RuntimeError):
    """An ACL call returned a non-zero code; the message names call and code."""

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        name = ACL_ERROR_NAMES.get(code, "")
        super().__init__(f"{call} returned ACL error {code}{f' ({name})' if name else ''}{detail}")
        self.code = code


class AclMemLocation(ctypes.Structure):
    """`aclrtMemLocation` as declared in CANN's acl_rt.h."""

    _fields_ = (("id", ctypes.c_uint32), ("type", ctypes.c_int))


class AclMemcpyBatchAttr(ctypes.Structure):
    """`aclrtMemcpyBatchAttr` as declared in CANN's acl_rt.h."""

    _fields_ = (
        ("dstLoc", AclMemLocation),
        ("srcLoc", AclMemLocation),
        ("rsv", ctypes.c_uint8 * 16),
    )


class AclLibrary:
    """ctypes bindings to the few libascendcl.so functions this backend calls."""

    _SIGNATURES: ClassVar[dict[str, tuple[Any, ...]]] = {
        "aclrtHostRegisterV2": (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32),
        "aclrtHostUnregister": (ctypes.c_void_p,),
        "aclrtGetDevice": (ctypes.POINTER(ctypes.c_int32),),
        "aclrtMemcpyAsync": (
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ),
        "aclrtMemcpyBatchAsync": (
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_size_t,
            ctypes.POINTER(AclMemcpyBatchAttr),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_void_p,
        ),
    }

    def __init__(self, library: Any) -> None:
        self._functions: dict[str, Callable[..., int]] = {}
        for name, argtypes in self._SIGNATURES.items():
            function = getattr(library, name, None)
            if function is None:
                continue
            function.argtypes = argtypes
            function.restype = ctypes.c_int
            self._functions[name] = function

    @classmethod
    def load(cls, path: str = "libascendcl.so") -> AclLibrary | None:
        """The bindings, or None where CANN's runtime library cannot be loaded."""
        try:
            return cls(ctypes.CDLL(path))
        except OSError:
            return None

    def has(self, name: str) -> bool:
        return name in self._functions

    def call(self, name: str, *args: Any) -> int:
        return int(self._functions[name](*args))


def find_batch_op() -> Callable[..., None] | None:
    """vllm-ascend's batched copy op, if the installed stack registered it."""
    try:
        op = torch.ops._C_ascend.swap_blocks_batch
    except (AttributeError, RuntimeError):
        return None
    return op


def _op_takes_direction(op: Any) -> bool:
    """Whether the op has the 4-argument form (with a direction)."""
    try:
        return len(op.default._schema.arguments) >= 4
    except AttributeError:
        return True


class NpuRuntime:
    """The Ascend implementation of `DeviceRuntime` (see the module docstring).

    `npu` (the `torch.npu` namespace), `acl` (libascendcl bindings) and
    `batch_op` are looked up when not given; tests pass fakes.
    """

    name = "NPU"
    max_batch_descriptors: int | None = MAX_BATCH_DESCRIPTORS

    def __init__(
        self,
        npu: Any = None,
        acl: AclLibrary | None = None,
        batch_op: Callable[..., None] | None = None,
        *,
        load_acl: bool = True,
    ) -> None:
        if npu is None:
            try:
                import torch_npu  # noqa: F401  (registers torch.npu)
            except ImportError as exc:
                raise RuntimeError(
                    "AscendECCPUWorker needs torch_npu (with a CANN runtime) in the worker "
                    f"process: {exc}. Install vllm-ascend's torch_npu; on a CPU host the "
                    "platform's backend is ec-worker-cpu"
                ) from exc
            npu = torch.npu  # type: ignore[attr-defined]
        if not npu.is_available():
            raise RuntimeError(
                "AscendECCPUWorker needs an Ascend NPU: torch.npu.is_available() is False"
            )
        self.npu = npu
        self.acl = acl if acl is not None or not load_acl else AclLibrary.load()
        self._batch_op = batch_op if batch_op is not None else find_batch_op()
        self._batch_op_direction = self._batch_op is not None and _op_takes_direction(
            self._batch_op
        )
        self._acl_batch_ok = self.acl is not None and self.acl.has("aclrtMemcpyBatchAsync")
        self._device_id: int | None = None
        self._unregister: Callable[[int], None] | None = None

    # -------------------------------------------------------- streams, events

    def current_stream(self) -> Any:
        return self.npu.current_stream()

    def new_stream(self) -> Any:
        return self.npu.Stream()

    def new_event(self) -> Any:
        return self.npu.Event(enable_timing=True)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.npu.stream(stream)  # type: ignore[no-any-return]

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        waiter.wait_stream(waitee)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type != "cpu":
            tensor.record_stream(stream)

    def synchronize_stream(self, stream: Any) -> None:
        stream.synchronize()

    def synchronize_device(self) -> None:
        self.npu.synchronize()

    # -------------------------------------------------------- registration

    def register_host(self, address: int, nbytes: int) -> None:
        npurt = getattr(self.npu, "npurt", None)
        if npurt is not None:
            rt = npurt()
            code = int(rt.npuHostRegister(address, nbytes, ACL_HOST_REG_PINNED))
            if code != 0:
                raise AclError("npuHostRegister", code)
            self._unregister = lambda ptr: self._check(
                "npuHostUnregister", rt.npuHostUnregister(ptr)
            )
            return
        if self.acl is not None and self.acl.has("aclrtHostRegisterV2"):
            code = self.acl.call("aclrtHostRegisterV2", address, nbytes, ACL_HOST_REG_PINNED)
            if code != 0:
                raise AclError("aclrtHostRegisterV2", code)
            acl = self.acl
            self._unregister = lambda ptr: self._check(
                "aclrtHostUnregister", acl.call("aclrtHostUnregister", ptr)
            )
            return
        raise RuntimeError(f"no host registration API found: needs {REGISTRATION_REQUIREMENT}")

    def unregister_host(self, address: int) -> None:
        unregister, self._unregister = self._unregister, None
        if unregister is None:
            raise RuntimeError("unregister_host without a registration")
        unregister(address)

    @staticmethod
    def _check(call: str, code: Any) -> None:
        if int(code) != 0:
            raise AclError(call, int(code))

    # --------------------------------------------------------------- copies

    def has_batch_copy(self) -> bool:
        return self._batch_op is not None or self._acl_batch_ok

    def batch_copy(self, batch: DescriptorBatch, direction: TransferDirection) -> object:
        if self._batch_op is not None:
            src, dst, sizes = batch.as_tensors()
            if self._batch_op_direction:
                flag = 0 if direction is TransferDirection.HOST_TO_DEVICE else 1
                self._batch_op(src, dst, sizes, flag)
            else:
                self._batch_op(src, dst, sizes)
            return (src, dst, sizes)
        return self._acl_batch(batch, direction)

    def _stream_handle(self) -> int:
        return int(self.current_stream().npu_stream)

    def _device(self) -> int:
        if self._device_id is None:
            assert self.acl is not None
            device = ctypes.c_int32(0)
            self._check("aclrtGetDevice", self.acl.call("aclrtGetDevice", ctypes.byref(device)))
            self._device_id = int(device.value)
        return self._device_id

    def _acl_batch(self, batch: DescriptorBatch, direction: TransferDirection) -> object:
        assert self.acl is not None
        n = len(batch)
        dsts = (ctypes.c_void_p * n)(*batch.dst)
        srcs = (ctypes.c_void_p * n)(*batch.src)
        sizes = (ctypes.c_size_t * n)(*batch.sizes)
        host = AclMemLocation(0, ACL_MEM_LOCATION_TYPE_HOST)
        device = AclMemLocation(self._device(), ACL_MEM_LOCATION_TYPE_DEVICE)
        attr = AclMemcpyBatchAttr()
        if direction is TransferDirection.HOST_TO_DEVICE:
            attr.srcLoc, attr.dstLoc = host, device
        else:
            attr.srcLoc, attr.dstLoc = device, host
        attrs = (AclMemcpyBatchAttr * 1)(attr)
        attr_indexes = (ctypes.c_size_t * 1)(0)
        fail_index = ctypes.c_size_t(0)
        stream = self._stream_handle()
        keep = (dsts, srcs, sizes, attrs, attr_indexes)
        if self._acl_batch_ok:
            code = self.acl.call(
                "aclrtMemcpyBatchAsync",
                dsts,
                sizes,  # destMaxs: each destination holds exactly its copy
                srcs,
                sizes,
                n,
                attrs,
                attr_indexes,
                1,
                ctypes.byref(fail_index),
                stream,
            )
            if code == 0:
                return keep
            if code != ACL_ERROR_RT_FEATURE_NOT_SUPPORT:
                raise AclError("aclrtMemcpyBatchAsync", code, f" at copy {fail_index.value}")
            self._acl_batch_ok = False  # not supported here: never again
        if not self.acl.has("aclrtMemcpyAsync"):
            raise AclError("aclrtMemcpyBatchAsync", ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
        kind = (
            ACL_MEMCPY_HOST_TO_DEVICE
            if direction is TransferDirection.HOST_TO_DEVICE
            else ACL_MEMCPY_DEVICE_TO_HOST
        )
        for src, dst, size in batch:
            code = self.acl.call("aclrtMemcpyAsync", dst, size, src, size, kind, stream)
            self._check("aclrtMemcpyAsync", code)
        return keep

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def device_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=f"npu:{self.npu.current_device()}")
