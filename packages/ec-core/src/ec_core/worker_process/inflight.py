"""The batches a worker has submitted and not yet reported.

Runs in worker processes. `InFlight` keeps them in submission order, hands
the landed ones to the step's report (acknowledgements and measured figures),
and says up to which step everything has settled. A batch that had landed
when it was submitted (a synchronous backend, a fallback copy) is not kept
as a batch at all: its acknowledgements wait in plain lists for the report.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ec_core._vllm import get_logger
from ec_core.metadata import ECCPUWorkerReport
from ec_core.worker_process.transfer import TransferDirection, TransferHandle

logger = get_logger(__name__)


@dataclass(slots=True)
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


class InFlight:
    """Submitted batches, until they land and are reported."""

    def __init__(self) -> None:
        self._transfers: list[Transfer] = []
        self._landed_saves: list[tuple[int, str]] = []
        """`(step, mm_hash)` of saves that landed on submission, not yet reported."""
        self._landed_loads: list[int] = []
        """Transfer ids of loads that landed on submission, not yet reported."""
        self._landed_figures = [0.0, 0.0, 0.0, 0.0]
        """bytes saved, save seconds, bytes loaded, load seconds of the landed ones."""

    def __len__(self) -> int:
        """Batches still in flight (not the landed ones waiting for the report)."""
        return len(self._transfers)

    def add(self, transfer: Transfer) -> None:
        self._transfers.append(transfer)

    def add_landed(
        self,
        direction: TransferDirection,
        step: int,
        *,
        keys: list[str],
        tids: list[int],
        nbytes: int,
        seconds: float,
    ) -> None:
        """Record a batch whose copies had all landed before it was handed over.

        It holds no tensor and no handle; the next `harvest` reports it (after
        the batches still tracked) exactly as it would a tracked batch."""
        figures = self._landed_figures
        if direction is TransferDirection.DEVICE_TO_HOST:
            self._landed_saves.extend([(step, key) for key in keys])
            figures[0] += nbytes
            figures[1] += seconds
        else:
            self._landed_loads.extend(tids)
            figures[2] += nbytes
            figures[3] += seconds

    def settled_through(self, step: int, unsubmitted: Iterable[int] = ()) -> int:
        """The last step all of whose copies have landed or failed.

        `step` is the newest step the worker was handed; `unsubmitted` are the
        steps of copies queued but not submitted yet.
        """
        transfers = self._transfers
        if not transfers and not unsubmitted:
            return step
        steps = [t.step for t in transfers]
        steps.extend(unsubmitted)
        return min(steps) - 1 if steps else step

    def harvest(self, rank: int, report: ECCPUWorkerReport) -> None:
        """Move every landed batch into `report` (acks and figures) and release it."""
        if self._transfers:
            self._harvest_tracked(rank, report)
        saves, loads = self._landed_saves, self._landed_loads
        if saves or loads:
            figures = self._landed_figures
            stats = report.stats
            if saves:
                report.completed_saves.extend([key for _, key in saves])
                report.save_acks.extend([(rank, step, key) for step, key in saves])
                self._landed_saves = []
                stats["bytes_saved"] = stats.get("bytes_saved", 0.0) + figures[0]
                stats["save_copy_seconds"] = stats.get("save_copy_seconds", 0.0) + figures[1]
            if loads:
                report.completed_loads.extend(loads)
                report.load_acks.extend([(rank, tid) for tid in loads])
                self._landed_loads = []
                stats["bytes_loaded"] = stats.get("bytes_loaded", 0.0) + figures[2]
                stats["load_copy_seconds"] = stats.get("load_copy_seconds", 0.0) + figures[3]
            self._landed_figures = [0.0, 0.0, 0.0, 0.0]

    def _harvest_tracked(self, rank: int, report: ECCPUWorkerReport) -> None:
        still: list[Transfer] = []
        stats = report.stats
        for transfer in self._transfers:
            handle = transfer.handle
            if not handle.query():
                still.append(transfer)
                continue
            seconds = handle.elapsed_seconds() or 0.0
            handle.release()
            transfer.keepalive.clear()
            if transfer.direction is TransferDirection.DEVICE_TO_HOST:
                keys = transfer.keys
                report.completed_saves.extend(keys)
                step = transfer.step
                report.save_acks.extend([(rank, step, key) for key in keys])
                stats["bytes_saved"] = stats.get("bytes_saved", 0.0) + transfer.nbytes
                stats["save_copy_seconds"] = stats.get("save_copy_seconds", 0.0) + seconds
            else:
                tids = transfer.tids
                report.completed_loads.extend(tids)
                report.load_acks.extend([(rank, tid) for tid in tids])
                stats["bytes_loaded"] = stats.get("bytes_loaded", 0.0) + transfer.nbytes
                stats["load_copy_seconds"] = stats.get("load_copy_seconds", 0.0) + seconds
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
