"""Connectors with injected faults, for engine tests (importable by module path)."""

from __future__ import annotations

from ec_core.metadata import ECCPUWorkerReport
from ec_scheduler.connector import ECCPUTierConnector
from ec_worker_cpu.worker import CpuECCPUWorker


class SilentLoadsWorker(CpuECCPUWorker):
    """Performs every copy but never reports a finished load (lost reports)."""

    def build_connector_worker_meta(self) -> ECCPUWorkerReport:
        report = super().build_connector_worker_meta()
        report.completed_loads.clear()
        report.load_acks.clear()
        return report


class SilentLoadsConnector(ECCPUTierConnector):
    worker_class = "ectools.faulty:SilentLoadsWorker"
