"""GPU checks for the CUDA backend (what they measure: `ectools.device_checks`).

    ec-gpu-checks [--out FILE] [--quick] [--fake]     (or python -m ectools.gpu_checks)
    hatch run cuda:gpu-checks [--out FILE]
    PYTHONPATH=packages/ec-testing/src python -m ectools.gpu_checks    (torch-only host)

Needs only torch (with CUDA) and this repository: on a host where nothing of it
is installed, run from the checkout root with this package's source on
`PYTHONPATH` (the product packages then come from the checkout); nothing is
fetched. Where vLLM is absent it says so and supplies labelled stand-ins for
the few vLLM names the worker imports; `CudaECCPUWorker`, `TorchCudaRuntime`,
`cudaHostRegister`, streams, events and the batched copy stay real. The batched
copy is vLLM's `swap_blocks_batch` where vLLM is installed, else the driver's
`cuMemcpyBatchAsync` through ctypes (`ectools.cuda_driver`), handed to the real
runtime; the table names which. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ectools.device_checks import ContiguousCopy, Device, prepare_imports, run_checks


def _worker_class() -> type[Any]:
    from ec_worker_cuda.worker import CudaECCPUWorker

    return CudaECCPUWorker


def _runtime() -> tuple[Any, str]:
    from ec_worker_cuda.runtime import TorchCudaRuntime
    from ectools import cuda_driver

    runtime = TorchCudaRuntime()
    if runtime.has_batch_copy():
        return runtime, "vLLM swap_blocks_batch"
    op = cuda_driver.batch_op()
    if op is None:
        return runtime, "none (no vLLM op, driver < 12.8): per-run copies only"
    return (
        TorchCudaRuntime(batch_op=op),
        "cuMemcpyBatchAsync via ctypes (the check's own op: vLLM's swap_blocks_batch is absent)",
    )


def _contiguous(runtime: Any) -> tuple[ContiguousCopy, str] | None:
    from ectools import cuda_driver

    copy = cuda_driver.contiguous_copy()
    if copy is None:
        return None
    return (lambda dst, src, nbytes, to_device: copy(dst, src, nbytes)), "cuMemcpyAsync"


CUDA = Device(
    label="CUDA backend GPU checks",
    register_call="cudaHostRegister",
    worker_class=_worker_class,
    make_runtime=_runtime,
    available=torch.cuda.is_available,
    device=lambda: torch.device("cuda"),
    synchronize=torch.cuda.synchronize,
    describe=lambda: f"device: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}",
    timing_event=lambda: torch.cuda.Event(enable_timing=True),
    contiguous_copy=_contiguous,
)


def main() -> int:
    """Run the checks on this host's GPU (or `--fake`); the exit status."""
    return run_checks(CUDA, standins=prepare_imports())


if __name__ == "__main__":
    sys.exit(main())
