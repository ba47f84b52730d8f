"""ec-worker-cuda: the EC CPU tier backend for NVIDIA GPUs (vLLM for CUDA).

Use it with `--ec-transfer-config '{"ec_connector": "CudaECCPUConnector",
"ec_connector_module_path": "ec_worker_cuda", "ec_role": "ec_both",
"ec_connector_extra_config": {"ec_cpu_bytes": "32GiB"}}'` (the module path may
be left out once the package is installed: its plugin registers the name).

Importing this package needs neither CUDA nor torch; the classes are imported
on first access and CUDA is touched only when a worker is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_core.lazy import lazy_exports

CONNECTOR_NAME = "CudaECCPUConnector"

_EXPORTS = {
    "CudaECCPUConnector": "ec_worker_cuda.connector",
    "CudaECCPUWorker": "ec_worker_cuda.worker",
    "TorchCudaRuntime": "ec_worker_cuda.runtime",
}

__all__ = ["CONNECTOR_NAME", "CudaECCPUConnector", "CudaECCPUWorker", "TorchCudaRuntime"]

if TYPE_CHECKING:
    from ec_worker_cuda.connector import CudaECCPUConnector
    from ec_worker_cuda.runtime import TorchCudaRuntime
    from ec_worker_cuda.worker import CudaECCPUWorker

__getattr__ = lazy_exports(__name__, _EXPORTS)
