"""ec-worker-ascend: the EC CPU tier backend for Huawei Ascend NPUs (vllm-ascend).

Use it with `--ec-transfer-config '{"ec_connector": "AscendECCPUConnector",
"ec_connector_module_path": "ec_worker_ascend", "ec_role": "ec_both",
"ec_connector_extra_config": {"ec_cpu_bytes": "32GiB"}}'` (the module path may
be left out once the package is installed: its plugin registers the name).

Importing this package needs neither torch_npu nor torch: torch_npu is
imported only when a worker is built, in a worker process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_core.lazy import lazy_exports

CONNECTOR_NAME = "AscendECCPUConnector"

_EXPORTS = {
    "AscendECCPUConnector": "ec_worker_ascend.connector",
    "AscendECCPUWorker": "ec_worker_ascend.worker",
    "NpuRuntime": "ec_worker_ascend.runtime",
}

__all__ = ["CONNECTOR_NAME", "AscendECCPUConnector", "AscendECCPUWorker", "NpuRuntime"]

if TYPE_CHECKING:
    from ec_worker_ascend.connector import AscendECCPUConnector
    from ec_worker_ascend.runtime import NpuRuntime
    from ec_worker_ascend.worker import AscendECCPUWorker

__getattr__ = lazy_exports(__name__, _EXPORTS)
