"""Connectors with injected faults, for engine tests (importable by module path)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from ec_core.metadata import ECCPUWorkerReport
from ec_core.worker_process.transfer import DescriptorBatch, TransferDirection, TransferHandle
from ec_scheduler.shell.connector import ECCPUTierConnector
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


class FailingLoadsWorker(CpuECCPUWorker):
    """Every batched load submission raises on the ranks in `failing_ranks` (None: all)."""

    failing_ranks: ClassVar[frozenset[int] | None] = None

    def _submit_transfer(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: Sequence[torch.Tensor],
    ) -> TransferHandle:
        failing = self.failing_ranks
        if direction is TransferDirection.HOST_TO_DEVICE and (
            failing is None or self.rank_info.rank in failing
        ):
            raise RuntimeError(f"injected load submission failure on rank {self.rank_info.rank}")
        return super()._submit_transfer(batch, direction, keepalive)


class RankOneFailingLoadsWorker(FailingLoadsWorker):
    failing_ranks = frozenset({1})


class FailingLoadsConnector(ECCPUTierConnector):
    worker_class = "ectools.faulty:FailingLoadsWorker"


class RankOneFailingLoadsConnector(ECCPUTierConnector):
    worker_class = "ectools.faulty:RankOneFailingLoadsWorker"
