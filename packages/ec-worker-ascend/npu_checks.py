"""Hardware checks for the Ascend backend (see tools/ectools/device_checks.py).

    hatch run ascend:npu-checks [--quick] [--fake]
    python packages/ec-worker-ascend/npu_checks.py [--quick] [--fake]

Byte-exact bf16 round trips (16 to 16384 rows x 4096) through the real
AscendECCPUWorker and real NPU streams; save/load bandwidth for 1, 8, 64 MB
next to a plain pinned `tensor.copy_`, with the ratio; host registration time;
one table; exit 1 on any mismatch. Needs vllm-ascend with torch_npu and CANN.
Without an NPU it says so and exits 0.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import torch

from ec_worker_ascend.runtime import NpuRuntime
from ec_worker_ascend.worker import AscendECCPUWorker
from ectools.device_checks import Device, run_checks


def _npu() -> Any:
    import torch_npu  # noqa: F401

    return torch.npu  # type: ignore[attr-defined]


def _available() -> bool:
    return importlib.util.find_spec("torch_npu") is not None and bool(_npu().is_available())


NPU = Device(
    label="Ascend backend NPU checks",
    register_call="host registration (npuHostRegister/aclrtHostRegisterV2)",
    worker_class=AscendECCPUWorker,
    runtime_class=NpuRuntime,
    available=_available,
    device=lambda: torch.device(f"npu:{_npu().current_device()}"),
    synchronize=lambda: _npu().synchronize(),
    describe=lambda: f"device: {_npu().get_device_name()}",
)

if __name__ == "__main__":
    sys.exit(run_checks(NPU))
