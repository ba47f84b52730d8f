"""The connector class vLLM instantiates for the CUDA backend."""

from __future__ import annotations

from ec_scheduler.connector import ECCPUTierConnector


class CudaECCPUConnector(ECCPUTierConnector):
    """EC CPU tier on NVIDIA GPUs: ECCPUScheduler + CudaECCPUWorker."""

    worker_class = "ec_worker_cuda.worker:CudaECCPUWorker"
