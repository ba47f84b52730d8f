"""GPU checks for the CUDA backend (see tools/ectools/device_checks.py).

    hatch run cuda:gpu-checks [--quick] [--fake]
    python packages/ec-worker-cuda/gpu_checks.py [--quick] [--fake]

Byte-exact bf16 round trips (16 to 16384 rows x 4096) through the real
CudaECCPUWorker and real CUDA streams; save/load bandwidth for 1, 8, 64 MB next
to a plain pinned `tensor.copy_`, with the ratio; `cudaHostRegister` time; one
table; exit 1 on any mismatch. Needs vLLM for CUDA (vllm==0.33.0). Without a
GPU it says so and exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import torch

from ec_worker_cuda.runtime import TorchCudaRuntime
from ec_worker_cuda.worker import CudaECCPUWorker
from ectools.device_checks import Device, run_checks

CUDA = Device(
    label="CUDA backend GPU checks",
    register_call="cudaHostRegister",
    worker_class=CudaECCPUWorker,
    runtime_class=TorchCudaRuntime,
    available=torch.cuda.is_available,
    device=lambda: torch.device("cuda"),
    synchronize=torch.cuda.synchronize,
    describe=lambda: f"device: {torch.cuda.get_device_name()}",
)

if __name__ == "__main__":
    sys.exit(run_checks(CUDA))
