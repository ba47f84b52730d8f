"""The batches a worker has submitted and not yet reported.

Runs in worker processes. `InFlight` keeps them in submission order, hands
the landed ones to the step's report (acknowledgements and measured figures),
and says up to which step everything has settled.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ec_core._vllm import get_logger
from ec_core.metadata import ECCPUWorkerReport
from ec_core.worker_process.transfer import TransferDirection, TransferHandle

logger = get_logger(__name__)


@dataclass
class Transfer:
    """One submitted batch and what to report when it lands."""

    direction: TransferDirection
    handle: TransferHandle
    step: int
    """The metadata step the batch's copies were asked for in."""
    keys: list[str] = field(default_factory=list)
    """mm_hashes of the saves in the batch."""
    tids: list[int] = field(default_factory=list)
    """Transfer ids of the loads in the batch."""
    nbytes: int = 0
    keepalive: list[torch.Tensor] = field(default_factory=list)
    """Tensors the copies read or write; held until the batch has landed."""


def _add(stats: dict[str, float], name: str, value: float) -> None:
    stats[name] = stats.get(name, 0.0) + value


class InFlight:
    """Submitted batches, until they land and are reported."""

    def __init__(self) -> None:
        self._transfers: list[Transfer] = []

    def __len__(self) -> int:
        return len(self._transfers)

    def add(self, transfer: Transfer) -> None:
        self._transfers.append(transfer)

    def settled_through(self, step: int, unsubmitted: Iterable[int] = ()) -> int:
        """The last step all of whose copies have landed or failed.

        `step` is the newest step the worker was handed; `unsubmitted` are the
        steps of copies queued but not submitted yet.
        """
        steps = [t.step for t in self._transfers] + list(unsubmitted)
        return min(steps) - 1 if steps else step

    def harvest(self, rank: int, report: ECCPUWorkerReport) -> None:
        """Move every landed batch into `report` (acks and figures) and release it."""
        still: list[Transfer] = []
        for transfer in self._transfers:
            if not transfer.handle.query():
                still.append(transfer)
                continue
            seconds = transfer.handle.elapsed_seconds() or 0.0
            transfer.handle.release()
            transfer.keepalive.clear()
            if transfer.direction is TransferDirection.DEVICE_TO_HOST:
                report.completed_saves.extend(transfer.keys)
                report.save_acks.extend((rank, transfer.step, key) for key in transfer.keys)
                _add(report.stats, "bytes_saved", transfer.nbytes)
                _add(report.stats, "save_copy_seconds", seconds)
            else:
                report.completed_loads.extend(transfer.tids)
                report.load_acks.extend((rank, tid) for tid in transfer.tids)
                _add(report.stats, "bytes_loaded", transfer.nbytes)
                _add(report.stats, "load_copy_seconds", seconds)
        self._transfers = still

    def drain(self) -> None:
        """Wait for every batch and release it (shutdown); failures are logged, not raised."""
        for transfer in self._transfers:
            try:
                transfer.handle.synchronize()
                transfer.handle.release()
            except Exception:
                logger.exception("EC CPU tier: waiting for a transfer at shutdown failed")
        self._transfers.clear()
