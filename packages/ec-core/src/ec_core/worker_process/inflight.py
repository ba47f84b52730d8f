"""The batches a worker has submitted and not yet reported.

Runs in worker processes. `InFlight` keeps them in submission order, hands
the landed ones to the step's report (acknowledgements and measured figures),
and says up to which step everything has settled. A batch that had landed
when it was submitted (a synchronous backend, a fallback copy) is not kept
as a batch at all: its acknowledgements and figures go straight into the
report the next `harvest` returns, where a tracked batch's go once it has
landed. A tracked batch whose copy fails on the device (its handle raises
when polled) is over too: its saves are reported failed, and its loads stop
the engine with `ECCPULoadError` (the step already used their buffers).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat

import torch

from ec_core._vllm import get_logger
from ec_core.metadata import ECCPUWorkerReport
from ec_core.ratelimit import RateLimitedWarnings
from ec_core.worker_process.entries import ECCPULoadError
from ec_core.worker_process.transfer import SAVE, TransferDirection, TransferHandle

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
    """Submitted batches, until they land and are reported (for the worker of `rank`)."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._transfers: list[Transfer] = []
        self._landed = ECCPUWorkerReport()
        """What has landed since the last harvest, already in report form (its
        acknowledgements and figures, and the saves of batches that failed on the
        device): the next harvest returns it."""
        self._warnings = RateLimitedWarnings(logger)

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
        """Record a batch whose copies have all landed: the next `harvest` reports it.

        A batch that landed before it was handed over comes here directly, holding
        no tensor and no handle; a tracked one once `harvest` finds it landed."""
        report = self._landed
        stats = report.stats
        rank = repeat(self._rank)  # (zip builds the acks without a Python frame)
        if direction is SAVE:
            report.completed_saves.extend(keys)
            report.save_acks.extend(zip(rank, repeat(step), keys, strict=False))
            stats["bytes_saved"] = stats.get("bytes_saved", 0.0) + nbytes
            stats["save_copy_seconds"] = stats.get("save_copy_seconds", 0.0) + seconds
        else:
            report.completed_loads.extend(tids)
            report.load_acks.extend(zip(rank, tids, strict=False))
            stats["bytes_loaded"] = stats.get("bytes_loaded", 0.0) + nbytes
            stats["load_copy_seconds"] = stats.get("load_copy_seconds", 0.0) + seconds

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

    def harvest(self) -> ECCPUWorkerReport:
        """A new report of every batch that has landed since the last harvest, in the
        order they were found landed (acknowledgements and figures only: the caller
        fills in the rest); the tracked ones among them are released.

        A batch whose copy failed on the device is dropped: its saves are in the
        report's `failed_saves`; a failed load raises ECCPULoadError once, after
        every other batch was polled (what landed is in the next report)."""
        if self._transfers:
            self._harvest_tracked()
        report = self._landed
        self._landed = ECCPUWorkerReport()
        return report

    def _harvest_tracked(self) -> None:
        still: list[Transfer] = []
        failed_loads: list[tuple[Transfer, Exception]] = []
        for transfer in self._transfers:
            handle = transfer.handle
            try:
                landed = handle.query()
            except Exception as exc:
                # The copy failed on the device. Its handle is not released: a
                # stream or event in error must not carry a later batch.
                transfer.keepalive.clear()
                if transfer.direction is SAVE:
                    self._fail_saves(transfer, exc)
                else:
                    failed_loads.append((transfer, exc))
                continue
            if not landed:
                still.append(transfer)
                continue
            seconds = handle.elapsed_seconds() or 0.0
            handle.release()
            transfer.keepalive.clear()
            self.add_landed(
                transfer.direction,
                transfer.step,
                keys=transfer.keys,
                tids=transfer.tids,
                nbytes=transfer.nbytes,
                seconds=seconds,
            )
        self._transfers = still
        if failed_loads:
            tids = [tid for transfer, _ in failed_loads for tid in transfer.tids]
            raise ECCPULoadError(
                f"EC CPU tier: the asynchronous load of transfer(s) {tids} on rank "
                f"{self._rank} failed on the device ({failed_loads[0][1]!r}); the step "
                "that used the loaded encoder outputs cannot be trusted"
            ) from failed_loads[0][1]

    def _fail_saves(self, transfer: Transfer, exc: Exception) -> None:
        """Report the saves of a batch whose copy failed on the device as failed."""
        rank, step = self._rank, transfer.step
        self._landed.failed_saves.extend((rank, step, key) for key in transfer.keys)
        self._warnings.warn(
            "save-device",
            "EC CPU tier: a batched save of %d entries (step %d) on rank %d failed on the "
            "device (%r); they are reported failed and encoded again when needed",
            len(transfer.keys),
            step,
            rank,
            exc,
        )

    def drain(self) -> None:
        """Wait for every batch and release it (shutdown); failures are logged, not raised."""
        for transfer in self._transfers:
            try:
                transfer.handle.synchronize()
                transfer.handle.release()
            except Exception:
                logger.exception("EC CPU tier: waiting for a transfer at shutdown failed")
        self._transfers.clear()
