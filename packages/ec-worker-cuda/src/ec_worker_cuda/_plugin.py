"""vLLM general plugin: registers `CudaECCPUConnector` (strings only, idempotent)."""

from __future__ import annotations


def register() -> None:
    from ec_core.registration import register_connector

    register_connector("CudaECCPUConnector", "ec_worker_cuda.connector", "CudaECCPUConnector")
