"""Hardware checks for the Ascend backend (what they measure: `ectools.device_checks`).

    ec-npu-checks [--out FILE] [--quick] [--fake]     (or python -m ectools.npu_checks)
    hatch run ascend:npu-checks [--out FILE]
    PYTHONPATH=packages/ec-testing/src python -m ectools.npu_checks    (bare host)

Needs torch_npu with CANN and this repository; on a host where nothing of it is
installed, run from the checkout root with this package's source on
`PYTHONPATH`. Where vLLM
is absent it supplies the same labelled stand-ins as the CUDA check; the
`AscendECCPUWorker`, `NpuRuntime`, host registration, streams, events and the
batched copy (vllm-ascend's op or `aclrtMemcpyBatchAsync`) stay real. The
contiguous reference is one `aclrtMemcpyAsync`. Never run on an NPU (none has
been available to this project): see the package README. Without an NPU it
says so and exits 0.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import torch

from ectools.device_checks import ContiguousCopy, Device, prepare_imports, run_checks


def _npu() -> Any:
    import torch_npu  # noqa: F401

    return torch.npu  # type: ignore[attr-defined]


def _available() -> bool:
    return importlib.util.find_spec("torch_npu") is not None and bool(_npu().is_available())


def _worker_class() -> type[Any]:
    from ec_worker_ascend.worker import AscendECCPUWorker

    return AscendECCPUWorker


def _runtime() -> tuple[Any, str]:
    from ec_worker_ascend.runtime import NpuRuntime

    runtime = NpuRuntime()
    if runtime._batch_op is not None:
        return runtime, "vllm-ascend swap_blocks_batch"
    if runtime.has_batch_copy():
        return runtime, "aclrtMemcpyBatchAsync via ctypes"
    return runtime, "none: per-run copies only"


def _contiguous(runtime: Any) -> tuple[ContiguousCopy, str] | None:
    from ec_worker_ascend.runtime import ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE

    acl = runtime.acl
    if acl is None or not acl.has("aclrtMemcpyAsync"):
        return None

    def copy(dst: int, src: int, nbytes: int, to_device: bool) -> None:
        kind = ACL_MEMCPY_HOST_TO_DEVICE if to_device else ACL_MEMCPY_DEVICE_TO_HOST
        stream = int(runtime.current_stream().npu_stream)
        code = acl.call("aclrtMemcpyAsync", dst, nbytes, src, nbytes, kind, stream)
        if code != 0:
            raise RuntimeError(f"aclrtMemcpyAsync returned {code}")

    return copy, "aclrtMemcpyAsync"


NPU = Device(
    label="Ascend backend NPU checks",
    register_call="host registration (npuHostRegister/aclrtHostRegisterV2)",
    worker_class=_worker_class,
    make_runtime=_runtime,
    available=_available,
    device=lambda: torch.device(f"npu:{_npu().current_device()}"),
    synchronize=lambda: _npu().synchronize(),
    describe=lambda: f"device: {_npu().get_device_name()}",
    timing_event=lambda: _npu().Event(enable_timing=True),
    contiguous_copy=_contiguous,
)


def main() -> int:
    """Run the checks on this host's NPU (or `--fake`); the exit status."""
    return run_checks(NPU, standins=prepare_imports())


if __name__ == "__main__":
    sys.exit(main())
