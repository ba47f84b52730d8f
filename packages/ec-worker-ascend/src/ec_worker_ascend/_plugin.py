"""vLLM general plugin: registers `AscendECCPUConnector` (strings only, idempotent)."""

from __future__ import annotations


def register() -> None:
    from ec_core.registration import register_connector

    register_connector("AscendECCPUConnector", "ec_worker_ascend.connector", "AscendECCPUConnector")
