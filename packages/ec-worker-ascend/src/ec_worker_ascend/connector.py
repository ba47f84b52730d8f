"""The connector class vLLM instantiates for the Ascend backend."""

from __future__ import annotations

from ec_scheduler.connector import ECCPUTierConnector


class AscendECCPUConnector(ECCPUTierConnector):
    """EC CPU tier on Ascend NPUs: ECCPUScheduler + AscendECCPUWorker."""

    worker_class = "ec_worker_ascend.worker:AscendECCPUWorker"
