"""vLLM general plugin: registers `CpuECCPUConnector` (strings only, idempotent)."""

from __future__ import annotations


def register() -> None:
    from ec_core.registration import register_connector

    register_connector("CpuECCPUConnector", "ec_worker_cpu.connector", "CpuECCPUConnector")
