"""ECCPUWorker: everything a worker process does that is not device specific.

It opens the region, turns each step's saves and loads into copy descriptors
(one per run of consecutive blocks), submits one batch per direction per
step through the backend's hooks (`hooks.py`), falls back to synchronous
copies when a batch cannot be submitted, tracks the batches in flight
(`inflight.py`) and reports every step. This module holds its life cycle
(start-up, steps, reports, shutdown); the load path is `loading.py`, the save
path `saving.py`, and the copies both make `copying.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from ec_core import report_channel
from ec_core._vllm import get_logger
from ec_core.layout import RegionLayout, region_layout
from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_core.ratelimit import RateLimitedWarnings
from ec_core.region.mapping import ECSharedRegion
from ec_core.region.opening import open_region
from ec_core.report_channel import ReportSender
from ec_core.worker_process.entries import PendingSave
from ec_core.worker_process.inflight import InFlight
from ec_core.worker_process.loading import EntryLoads
from ec_core.worker_process.ranks import RankInfo, detect_rank_info
from ec_core.worker_process.saving import EntrySaves

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)


class ECCPUWorker(EntryLoads, EntrySaves):
    """The device-independent worker half; a backend subclasses it and fills the hooks
    (`ec_core.worker_process.hooks`).

    Guarantees:
      * one submission per direction per step; an entry occupying one run of
        blocks is one descriptor;
      * every load in the step's metadata is in `encoder_cache` when
        `start_load_caches` returns, as a tensor of the recorded `(rows,
        cols)` shape and the model dtype, in a buffer of its own (its device
        memory lives exactly as long as vLLM keeps the entry). When the
        batched path fails (the submission or the buffer allocation raises),
        the entry is copied synchronously from the region instead and counted
        as a fallback; only when that fails too does `start_load_caches`
        raise, with an `ECCPULoadError` naming entry, backend and causes;
      * a save is made only of a tensor of exactly the shape the scheduler
        allocated and of the region's dtype; any other is skipped with a
        rate-limited warning and reported failed. A save whose batch fails is
        copied synchronously; if that fails too it is reported failed. A batch
        that fails on the device after it was submitted (its handle raises when
        polled) is reported failed if it saves; if it loads,
        `build_connector_worker_meta` raises an `ECCPULoadError` (once);
      * nothing is ever written at or above the region's reservation
        watermark (`ec_core.region.reservation`), whatever block ids the
        scheduler sent: such a save is refused with a rate-limited warning
        and reported failed (the entry is encoded again later);
      * every step this worker runs produces a report naming its rank and the
        step up to which its copies have settled (see ECCPUWorkerReport);
      * shutdown removes the region's file (the creator's) first, then waits
        for copies in flight, releases the backend, then unmaps the region —
        the region's cleanup happens even if the backend fails.
    """

    registers_whole_region: ClassVar[bool] = False
    """True for a backend that registers (pins) the whole mapping when it starts
    (`_pin_shared_region`): that faults in every page, so such a worker has the
    region reserved in full before it returns, never in the background."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        *,
        layout: RegionLayout | None = None,
        rank_info: RankInfo | None = None,
    ) -> None:
        ec_config = vllm_config.ec_transfer_config
        if ec_config is None:
            raise ValueError("ECCPUWorker needs an ec_transfer_config")
        self.vllm_config = vllm_config
        self.layout = layout if layout is not None else region_layout(vllm_config)
        self.is_producer = bool(ec_config.is_ec_producer)
        self.is_consumer = bool(ec_config.is_ec_consumer)
        self.dtype = self.layout.dtype
        self._itemsize = self.dtype.itemsize
        self._backend_name = type(self).__name__
        self.block_size = self.layout.block_size_bytes
        self.rank_info = rank_info if rank_info is not None else detect_rank_info()
        self.saves_here = self.is_producer and self.rank_info.is_save_rank
        self.region: ECSharedRegion = open_region(
            self.layout, background_reserve=not self.registers_whole_region
        )
        self._side_channel: ReportSender | None = None
        self._region_bytes = torch.empty(0, dtype=torch.uint8)
        try:
            self._open(vllm_config)
        except BaseException:
            self._undo_open()
            raise
        logger.info(
            "EC CPU tier worker (%s): rank %d%s, region %s",
            type(self).__name__,
            self.rank_info.rank,
            " (saves)" if self.saves_here else "",
            self.region.path,
        )

    def _undo_open(self) -> None:
        """A constructor that raises leaves nothing open: no socket, no mapping, no file."""
        if self._side_channel is not None:
            self._side_channel.close()
        self._region_bytes = torch.empty(0, dtype=torch.uint8)
        self.region.cleanup()

    def _open(self, vllm_config: VllmConfig) -> None:
        """The constructor's part once the region is open: whatever it raises, the
        constructor closes what it opened."""
        self._reserved_blocks = self.region.reserved_blocks
        """The watermark last read from the region (it only grows): saves below it
        pass with one compare; one beyond it re-reads it (`_unreserved_problem`)."""
        self._region_bytes = self.region.blocks.view(-1).view(torch.uint8)
        self._region_base = self.region.base_address  # fixed while the mapping is open
        self._num_blocks = self.region.num_blocks
        self._warnings = RateLimitedWarnings(logger)
        self._step = 0
        self._bound_saves: dict[str, list[int]] = {}
        self._rank = self.rank_info.rank
        self._group_size = self.rank_info.group_size
        self._inflight = InFlight(self._rank)
        self._pending_saves: list[PendingSave] = []
        self._queued: set[str] = set()
        self._save_keys = (None, {})
        self._failed_saves: list[tuple[int, str]] = []
        self._fallbacks: list[str] = []
        self._closed = False
        peers = self.layout.settings.peers
        if peers is not None and report_channel.needed(
            vllm_config, listening=peers.listen is not None
        ):
            self._side_channel = ReportSender(
                report_channel.endpoint(self.layout.path), peers.keyring()
            )
        self._pin_shared_region()

    # --------------------------------------------------------------- steps

    def bind(self, metadata: ECCPUConnectorMetadata) -> None:
        """A step starts: remember its number and the saves it owes. If the previous
        step did not end in `get_finished` (vLLM skips it when `start_load_caches`
        raises), it is ended here, as `get_finished` would: its saves submitted, those
        never produced reported failed."""
        if self._pending_saves or self._bound_saves:
            self.get_finished()
        self._step = max(self._step, metadata.step)
        self._bound_saves = metadata.saves
        if self._queued:
            self._queued.clear()

    # --------------------------------------------------------------- loads
    # ----------------------------------------------------------- reporting

    def get_finished(self) -> None:
        """End of the step's forward part: submit the save batch.

        Saves the scheduler allocated for this step whose encoder output never
        reached `save_caches` (the step failed, or the item was not encoded
        here) are reported failed, so their blocks come back at once.
        """
        if self._pending_saves:
            self.flush_saves()
        if self._bound_saves:
            if self.saves_here:
                queued = self._queued
                for key in self._bound_saves:
                    if key not in queued:
                        self._failed_saves.append((self._step, key))
            self._bound_saves = {}
        self._queued.clear()

    def settled_through(self) -> int:
        """The last step all of whose copies on this rank have landed or failed."""
        pending = self._pending_saves
        return self._inflight.settled_through(
            self._step, [save.step for save in pending] if pending else ()
        )

    def build_connector_worker_meta(self) -> ECCPUWorkerReport:
        """Report every batch that has landed, failed saves, fallbacks, and this rank's progress."""
        rank = self._rank
        report = self._inflight.harvest()
        report.group_size = self._group_size
        report.progress.append((rank, self._step, self.settled_through()))
        if self._failed_saves:
            report.failed_saves.extend((rank, step, key) for step, key in self._failed_saves)
            self._failed_saves = []
        if self._fallbacks:
            report.fallbacks.extend((rank, kind) for kind in self._fallbacks)
            self._fallbacks = []
        if self._side_channel is not None:
            self._side_channel.send(report)  # vLLM drops it on this engine
        return report

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Remove the region's file, wait for copies, release the backend, then
        unmap the region. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Before any wait: vLLM SIGKILLs a worker still shutting down 5 s after it
        # asked the engine to stop, and the file would then outlive it. The
        # mapping stays, so copies in flight still land.
        self.region.remove_file()
        try:
            self._inflight.drain()
            self._pending_saves.clear()
            try:
                self._shutdown_transfer_backend()
            except Exception:
                logger.exception("EC CPU tier: releasing the transfer backend failed")
        finally:
            if self._side_channel is not None:
                self._side_channel.close()
            self._region_bytes = torch.empty(0, dtype=torch.uint8)
            self.region.cleanup()
