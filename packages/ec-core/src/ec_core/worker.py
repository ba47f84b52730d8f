"""ECCPUWorker: everything a worker does that is not device specific.

It opens the region, turns each step's saves and loads into copy descriptors
(one per run of consecutive blocks), submits one batch per direction per
step through the backend's hooks, tracks the batches in flight and reports
finished copies every step. A backend subclass fills only the hooks:

    _pin_shared_region()            make the mapping DMA-able (or do nothing)
    _submit_transfer(batch, dir, keepalive) -> TransferHandle
                                    enqueue one batch of copies
    _new_device_buffer(nbytes)      memory for one loaded entry
    _shutdown_transfer_backend()    release what the backend holds

Per step (vLLM's order): `start_load_caches` copies the step's loads into
fresh per-entry buffers and publishes them in `encoder_cache`; the encoder
runs and `save_caches` queues each new output named in the step's saves;
`get_finished` submits the queued saves as one batch; and
`build_connector_worker_meta` reports every batch that has landed, the saves
that failed, and this rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ec_core._vllm import get_logger
from ec_core.layout import RegionLayout, open_region, region_layout
from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_core.region import ECSharedRegion
from ec_core.transfer import DescriptorBatch, TransferDirection, TransferHandle, block_runs

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)


@dataclass
class Transfer:
    """One submitted batch and what to report when it lands."""

    direction: TransferDirection
    handle: TransferHandle
    keys: list[str] = field(default_factory=list)
    """mm_hashes of the saves in the batch."""
    tids: list[int] = field(default_factory=list)
    """Transfer ids of the loads in the batch."""
    nbytes: int = 0
    descriptors: int = 0
    submitted: float = 0.0
    keepalive: list[torch.Tensor] = field(default_factory=list)
    """Tensors the copies read or write; held until the batch has landed."""


@dataclass
class _PendingSave:
    key: str
    source: torch.Tensor
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this worker sits: its global rank and whether it writes saves."""

    rank: int
    is_save_rank: bool


def _add(stats: dict[str, float], name: str, value: float) -> None:
    stats[name] = stats.get(name, 0.0) + value


def detect_rank_info() -> RankInfo:
    """Read the rank from vLLM's initialised process groups.

    Only one rank writes saves (tensor-parallel rank 0 of prefill-context
    rank 0: every such rank holds the same encoder output); every rank loads.
    """
    from vllm.distributed import parallel_state as ps

    try:
        rank = ps.get_world_group().rank
        tp_rank = ps.get_tensor_model_parallel_rank()
        pcp_rank = ps.get_pcp_group().rank_in_group if hasattr(ps, "get_pcp_group") else 0
    except (AssertionError, AttributeError, RuntimeError) as exc:
        logger.warning(
            "EC CPU tier: vLLM's process groups are not initialised (%s); assuming a "
            "single rank that saves and loads",
            exc,
        )
        return RankInfo(rank=0, is_save_rank=True)
    return RankInfo(rank=int(rank), is_save_rank=tp_rank == 0 and pcp_rank == 0)


class ECCPUWorker:
    """The device-independent worker half; subclass it and fill the hooks.

    Guarantees:
      * one submission per direction per step; an entry occupying one run of
        blocks is one descriptor;
      * a loaded entry is a tensor of the recorded `(rows, cols)` shape and the
        model dtype, in a buffer of its own, so its device memory lives exactly
        as long as vLLM keeps that entry;
      * a save whose source is larger or smaller than its allocation, or of an
        unexpected dtype, is skipped with a warning and reported as failed;
        a failed submission is reported (never raised into vLLM's step);
      * every step this worker runs produces a report naming its rank;
      * shutdown waits for copies in flight, then releases the backend, then
        the region — the region's cleanup happens even if the backend fails.
    """

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
        self.block_size = self.layout.block_size_bytes
        self.rank_info = rank_info if rank_info is not None else detect_rank_info()
        self.region: ECSharedRegion = open_region(self.layout)
        self._inflight: list[Transfer] = []
        self._pending_saves: list[_PendingSave] = []
        self._bound_saves: dict[str, list[int]] = {}
        self._queued: set[str] = set()
        self._failed_saves: list[str] = []
        self._failed_loads: list[int] = []
        self._closed = False
        try:
            self._pin_shared_region()
        except BaseException:
            self.region.cleanup()
            raise
        logger.info(
            "EC CPU tier worker (%s): rank %d%s, region %s",
            type(self).__name__,
            self.rank_info.rank,
            " (saves)" if self.rank_info.is_save_rank and self.is_producer else "",
            self.region.path,
        )

    # --------------------------------------------------------------- hooks

    def _pin_shared_region(self) -> None:
        """Make this process's mapping of the region usable for device copies."""

    def _submit_transfer(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: Sequence[torch.Tensor],
    ) -> TransferHandle:
        """Enqueue every copy of `batch`; return a handle that tells when they landed.

        `keepalive` are the device tensors the copies read (saves) or write
        (loads); the caller holds them until the handle reports completion. A
        hook that raises must first release whatever it acquired.
        """
        raise NotImplementedError

    def _new_device_buffer(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of `nbytes` on this worker's device (one loaded entry)."""
        raise NotImplementedError

    def _shutdown_transfer_backend(self) -> None:
        """Release backend resources; called after all copies landed, before the region goes."""

    # --------------------------------------------------------------- loads

    def bind(self, metadata: ECCPUConnectorMetadata) -> None:
        """A step starts: remember the saves it owes, to report any never made."""
        self._bound_saves = metadata.saves
        self._queued.clear()

    def start_load_caches(
        self, encoder_cache: dict[str, torch.Tensor], metadata: ECCPUConnectorMetadata
    ) -> None:
        """Copy this step's loads into `encoder_cache` before the embeddings are gathered."""
        if not metadata.loads or self._closed:
            return
        batch = DescriptorBatch()
        buffers: list[torch.Tensor] = []
        entries: list[tuple[str, torch.Tensor, tuple[int, int]]] = []
        tids: list[int] = []
        region_base = self.region.base_address
        itemsize = self.dtype.itemsize
        # Ascending first block keeps the region reads in address order.
        for key, (tid, block_ids, shape) in sorted(
            metadata.loads.items(), key=lambda item: item[1][1][0] if item[1][1] else -1
        ):
            rows, cols = shape
            nbytes = rows * cols * itemsize
            buffer = self._new_device_buffer(nbytes)
            batch.add_runs(
                block_runs(block_ids),
                region_base=region_base,
                block_size=self.block_size,
                other_base=int(buffer.data_ptr()),
                nbytes=nbytes,
                to_region=False,
            )
            buffers.append(buffer)
            entries.append((key, buffer, shape))
            tids.append(tid)
        if not self._submit(batch, TransferDirection.HOST_TO_DEVICE, buffers, tids=tids):
            return
        for key, buffer, shape in entries:
            encoder_cache[key] = buffer.view(self.dtype).view(shape)

    # --------------------------------------------------------------- saves

    def save_caches(
        self,
        encoder_cache: dict[str, torch.Tensor],
        mm_hash: str,
        metadata: ECCPUConnectorMetadata,
    ) -> None:
        """Queue `encoder_cache[mm_hash]` for this step's save batch."""
        if not (self.is_producer and self.rank_info.is_save_rank) or self._closed:
            return
        block_ids = metadata.saves.get(mm_hash)
        if block_ids is None or mm_hash in self._queued:
            return
        source = encoder_cache.get(mm_hash)
        if source is None:
            return  # reported as failed at the end of the step
        if source.dtype != self.dtype:
            self._reject_save(
                mm_hash,
                "its dtype is %s but the region holds %s",
                source.dtype,
                self.dtype,
            )
            return
        nbytes = source.numel() * source.element_size()
        capacity = len(block_ids) * self.block_size
        if nbytes > capacity or nbytes <= capacity - self.block_size:
            self._reject_save(
                mm_hash,
                "it holds %d bytes (shape %s) but %d blocks of %d bytes were allocated",
                nbytes,
                tuple(source.shape),
                len(block_ids),
                self.block_size,
            )
            return
        self._queued.add(mm_hash)
        self._pending_saves.append(_PendingSave(mm_hash, source.contiguous(), block_ids))

    def _reject_save(self, key: str, reason: str, *args: object) -> None:
        self._queued.add(key)
        self._failed_saves.append(key)
        logger.warning("EC CPU tier: not saving %s: " + reason, key, *args)

    def flush_saves(self) -> None:
        """Submit the step's queued saves as one batch."""
        pending, self._pending_saves = self._pending_saves, []
        if not pending or self._closed:
            return
        batch = DescriptorBatch()
        region_base = self.region.base_address
        for save in pending:
            batch.add_runs(
                block_runs(save.block_ids),
                region_base=region_base,
                block_size=self.block_size,
                other_base=int(save.source.data_ptr()),
                nbytes=save.source.numel() * save.source.element_size(),
                to_region=True,
            )
        sources = [save.source for save in pending]
        keys = [save.key for save in pending]
        self._submit(batch, TransferDirection.DEVICE_TO_HOST, sources, keys=keys)

    def _submit(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: list[torch.Tensor],
        *,
        keys: Sequence[str] = (),
        tids: Sequence[int] = (),
    ) -> bool:
        """Submit one batch; on failure report its copies as failed, never raise."""
        try:
            handle = self._submit_transfer(batch, direction, keepalive)
        except Exception:
            logger.exception(
                "EC CPU tier: submitting a %s batch of %d entries failed; they are "
                "reported as failed (a failed load is then a miss in vLLM's encoder cache)",
                direction.value,
                len(keys) + len(tids),
            )
            self._failed_saves.extend(keys)
            self._failed_loads.extend(tids)
            return False
        self._inflight.append(
            Transfer(
                direction,
                handle,
                keys=list(keys),
                tids=list(tids),
                nbytes=batch.nbytes,
                descriptors=len(batch),
                submitted=time.perf_counter(),
                keepalive=keepalive,
            )
        )
        return True

    # ----------------------------------------------------------- reporting

    def get_finished(self) -> None:
        """End of the step's forward part: submit the save batch."""
        self.flush_saves()
        # Saves the scheduler allocated for this step but whose encoder output
        # never reached save_caches (the step failed, or the item was not
        # encoded here) would otherwise stay not-ready until the report bound.
        if self.is_producer and self.rank_info.is_save_rank:
            for key in self._bound_saves:
                if key not in self._queued:
                    self._failed_saves.append(key)
        self._bound_saves = {}
        self._queued.clear()

    def build_connector_worker_meta(self) -> ECCPUWorkerReport:
        """Report every batch that has landed, failed copies, and this rank."""
        report = ECCPUWorkerReport(reporters=[self.rank_info.rank])
        rank = self.rank_info.rank
        still: list[Transfer] = []
        for transfer in self._inflight:
            if not transfer.handle.query():
                still.append(transfer)
                continue
            seconds = transfer.handle.elapsed_seconds()
            transfer.handle.release()
            transfer.keepalive.clear()
            if transfer.direction is TransferDirection.DEVICE_TO_HOST:
                report.completed_saves.extend(transfer.keys)
                _add(report.stats, "bytes_saved", transfer.nbytes)
                _add(report.stats, "save_copy_seconds", seconds or 0.0)
            else:
                report.completed_loads.extend(transfer.tids)
                report.load_acks.extend((rank, tid) for tid in transfer.tids)
                _add(report.stats, "bytes_loaded", transfer.nbytes)
                _add(report.stats, "load_copy_seconds", seconds or 0.0)
        self._inflight = still
        report.failed_saves.extend(self._failed_saves)
        report.failed_loads.extend((rank, tid) for tid in self._failed_loads)
        self._failed_saves = []
        self._failed_loads = []
        return report

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Wait for copies, release the backend, then the region. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for transfer in self._inflight:
                try:
                    transfer.handle.synchronize()
                    transfer.handle.release()
                except Exception:
                    logger.exception("EC CPU tier: waiting for a transfer at shutdown failed")
            self._inflight.clear()
            self._pending_saves.clear()
            try:
                self._shutdown_transfer_backend()
            except Exception:
                logger.exception("EC CPU tier: releasing the transfer backend failed")
        finally:
            self.region.cleanup()
