"""ECCPUWorker: everything a worker process does that is not device specific.

It opens the region, turns each step's saves and loads into copy descriptors
(one per run of consecutive blocks), submits one batch per direction per
step through the backend's hooks (`hooks.py`), falls back to synchronous
copies when a batch cannot be submitted, tracks the batches in flight
(`inflight.py`) and reports every step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
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
from ec_core.worker_process.entries import (
    ECCPULoadError,
    PendingSave,
    PlannedLoad,
    plan_load,
    save_problem,
)
from ec_core.worker_process.hooks import WorkerHooks
from ec_core.worker_process.inflight import InFlight, Transfer
from ec_core.worker_process.ranks import RankInfo, detect_rank_info
from ec_core.worker_process.transfer import (
    LOAD,
    SAVE,
    CompletedTransfer,
    DescriptorBatch,
    TransferDirection,
    checked_runs,
    entry_spans,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)


def _first_block_of_load(item: tuple[str, tuple[int, list[int], tuple[int, int]]]) -> int:
    """Sort key of a load: its first block (an entry without blocks first)."""
    block_ids = item[1][1]
    return block_ids[0] if block_ids else -1


class ECCPUWorker(WorkerHooks):
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
        self._failed_saves: list[tuple[int, str]] = []
        self._fallbacks: list[str] = []
        self._closed = False
        self._side_channel: ReportSender | None = None
        peers = self.layout.settings.peers
        try:
            if peers is not None and report_channel.needed(
                vllm_config, listening=peers.listen is not None
            ):
                self._side_channel = ReportSender(
                    report_channel.endpoint(self.layout.path), peers.secret.encode()
                )
            self._pin_shared_region()
        except BaseException:
            # A constructor that raises leaves nothing open: no socket, no mapping, no file.
            if self._side_channel is not None:
                self._side_channel.close()
            self._region_bytes = torch.empty(0, dtype=torch.uint8)
            self.region.cleanup()
            raise
        logger.info(
            "EC CPU tier worker (%s): rank %d%s, region %s",
            type(self).__name__,
            self.rank_info.rank,
            " (saves)" if self.saves_here else "",
            self.region.path,
        )

    # --------------------------------------------------------------- steps

    def bind(self, metadata: ECCPUConnectorMetadata) -> None:
        """A step starts: remember its number and the saves it owes."""
        if self._pending_saves:
            self.flush_saves()  # get_finished did not run for the previous step
        self._step = max(self._step, metadata.step)
        self._bound_saves = metadata.saves
        if self._queued:
            self._queued.clear()

    # --------------------------------------------------------------- loads

    def start_load_caches(
        self, encoder_cache: dict[str, torch.Tensor], metadata: ECCPUConnectorMetadata
    ) -> None:
        """Put every load of this step into `encoder_cache` (before vLLM gathers them).

        Batched first; an entry the batched path could not take (its buffer
        or the submission failed) is copied synchronously. Raises
        ECCPULoadError only when an entry could be copied by neither path.
        """
        loads_asked = metadata.loads
        if not loads_asked or self._closed:
            return
        dtype = self.dtype
        block_size = self.block_size
        num_blocks = self._num_blocks
        backend = self._backend_name
        runs_of = metadata.runs.get
        # Ascending first block keeps the region reads in address order.
        items = (
            sorted(loads_asked.items(), key=_first_block_of_load)
            if len(loads_asked) > 1
            else loads_asked.items()
        )
        loads = [
            plan_load(
                key,
                tid,
                block_ids,
                shape,
                dtype=dtype,
                block_size=block_size,
                num_blocks=num_blocks,
                backend=backend,
                sent_runs=runs_of(key),
            )
            for key, (tid, block_ids, shape) in items
        ]
        if len(loads) == 1:  # the usual step: the same as below, without the lists
            encoder_cache[loads[0].key] = self._load_one(loads[0])
            return
        staged: list[tuple[PlannedLoad, torch.Tensor]] = []
        unstaged: list[tuple[PlannedLoad, torch.Tensor | None, Exception]] = []
        batch = DescriptorBatch()
        new_buffer = self._new_entry_buffer
        describe = self._describe
        for load in loads:
            try:
                buffer = new_buffer(load.shape, dtype)
            except Exception as exc:
                unstaged.append((load, None, exc))
                continue
            describe(
                batch, load.block_ids, load.runs, buffer.data_ptr(), load.nbytes, to_region=False
            )
            staged.append((load, buffer))
        if staged:
            cause = self._submit(
                batch,
                LOAD,
                [buffer for _, buffer in staged],
                [],
                [load.tid for load, _ in staged],
            )
            if cause is not None:
                unstaged.extend((load, buffer, cause) for load, buffer in staged)
                staged = []
        # Every entry goes into the cache only once all have been copied (or none, if one
        # cannot be: `_load_now` raises).
        for load, maybe_buffer, cause in unstaged:
            staged.append((load, self._load_now(load, maybe_buffer, cause)))
        for load, buffer in staged:
            encoder_cache[load.key] = buffer

    def _load_one(self, load: PlannedLoad) -> torch.Tensor:
        """The entry of a step that loads only `load`, copied: what `start_load_caches`
        does for several, step for step (a batch of one descriptor per run, the
        same fallback), without building the lists. Raises as `_load_now` does."""
        try:
            buffer = self._new_entry_buffer(load.shape, self.dtype)
        except Exception as exc:
            return self._load_now(load, None, exc)
        batch = DescriptorBatch()
        self._describe(
            batch, load.block_ids, load.runs, buffer.data_ptr(), load.nbytes, to_region=False
        )
        cause = self._submit(batch, LOAD, [buffer], [], [load.tid])
        if cause is not None:
            return self._load_now(load, buffer, cause)
        return buffer

    def _load_now(
        self, load: PlannedLoad, buffer: torch.Tensor | None, cause: Exception
    ) -> torch.Tensor:
        """Copy one entry from the region synchronously (the fallback); raise if impossible."""
        began = time.perf_counter()
        try:
            if buffer is None:
                buffer = self._new_entry_buffer(load.shape, self.dtype)
            self._copy_entry_now(
                buffer, load.block_ids, load.nbytes, to_region=False, runs=load.runs
            )
        except Exception as exc:
            raise ECCPULoadError(
                f"EC CPU tier: cannot load encoder output {load.key!r} (transfer {load.tid}) "
                f"on rank {self.rank_info.rank} with {type(self).__name__}: the batched copy "
                f"failed ({cause!r}) and so did a synchronous copy from the region ({exc!r})"
            ) from exc
        self._fallbacks.append("load")
        self._record_done(LOAD, tids=[load.tid], nbytes=load.nbytes, began=began)
        return buffer

    # --------------------------------------------------------------- saves

    def save_caches(
        self,
        encoder_cache: dict[str, torch.Tensor],
        mm_hash: str,
        metadata: ECCPUConnectorMetadata,
    ) -> None:
        """Queue `encoder_cache[mm_hash]` for this step's save batch.

        vLLM calls it once per encoder output computed in the step. Not a save
        rank, or not a save the scheduler asked for: nothing happens.
        """
        if not self.saves_here or self._closed:
            return
        block_ids = metadata.saves.get(mm_hash)
        if block_ids is None or mm_hash in self._queued:
            return
        source = encoder_cache.get(mm_hash)
        if source is None:
            return  # reported as failed at the end of the step
        self._queued.add(mm_hash)
        shape = metadata.save_shapes.get(mm_hash)
        block_size = self.block_size
        nbytes = 0 if shape is None else math.prod(shape) * self._itemsize
        # The usual tensor passes on three compares (`torch.Size == tuple`); any
        # other goes through `save_problem`, which says what is wrong, if anything.
        if (
            shape is None
            or source.dtype != self.dtype
            or source.shape != shape
            or nbytes > len(block_ids) * block_size
        ):
            problem = save_problem(
                source, shape, block_ids, dtype=self.dtype, block_size=block_size
            )
            if problem is not None or shape is None:
                self._fail_save(
                    mm_hash, self._step, problem or "the scheduler sent no shape for it"
                )
                return
        runs = checked_runs(block_ids, metadata.runs.get(mm_hash))
        if len(runs) == 1:
            lowest, count = runs[0]
            end = lowest + count
        elif runs:
            lowest, end = min(runs)[0], max(first + count for first, count in runs)
        else:
            lowest = end = 0
        if end > self._reserved_blocks or lowest < 0:
            problem = self._unreserved_problem(lowest, end)
            if problem is not None:
                self._fail_save(mm_hash, self._step, problem, kind="save-unreserved")
                return
        try:
            data = source.contiguous()
        except RuntimeError as exc:  # a strided output's copy found no device memory
            self._fail_save(mm_hash, self._step, f"cannot make a contiguous copy of it: {exc}")
            return
        self._pending_saves.append(PendingSave(mm_hash, self._step, data, block_ids, nbytes, runs))

    def _unreserved_problem(self, lowest: int, end: int) -> str | None:
        """Why blocks `[lowest, end)` must not be written, or None once the
        re-read watermark covers them. Never raises."""
        if lowest >= 0 and end <= self.region.num_blocks:
            try:
                self._reserved_blocks = max(self._reserved_blocks, self.region.reserved_blocks)
            except Exception as exc:  # a closed region or a failed read: refuse
                logger.debug("EC CPU tier: cannot read the region's watermark: %s", exc)
            if end <= self._reserved_blocks:
                return None
        return (
            f"its blocks reach block {end - 1} (lowest {lowest}) but only blocks below "
            f"{self._reserved_blocks} of the region's {self.region.num_blocks} are reserved; "
            "the scheduler handed out blocks this region has not reserved"
        )

    def _fail_save(self, key: str, step: int, reason: str, *, kind: str = "save") -> None:
        self._failed_saves.append((step, key))
        self._warnings.warn(kind, "EC CPU tier: not saving %s: %s", key, reason)

    def flush_saves(self) -> None:
        """Submit the queued saves as one batch (they all belong to one step)."""
        pending = self._pending_saves
        if not pending:
            return
        self._pending_saves = []
        if self._closed:
            return
        batch = DescriptorBatch()
        describe = self._describe
        for save in pending:
            describe(
                batch,
                save.block_ids,
                save.runs,
                save.source.data_ptr(),
                save.nbytes,
                to_region=True,
            )
        if len(pending) == 1:  # the usual step: the same lists, built without a loop
            sources, keys = [pending[0].source], [pending[0].key]
        else:
            sources, keys = [save.source for save in pending], [save.key for save in pending]
        cause = self._submit(batch, SAVE, sources, keys, [])
        if cause is not None:
            for save in pending:
                self._save_now(save, cause)

    def _save_now(self, save: PendingSave, cause: Exception) -> None:
        """Copy one save into the region synchronously (the fallback), or report it failed."""
        began = time.perf_counter()
        try:
            self._copy_entry_now(
                save.source, save.block_ids, save.nbytes, to_region=True, runs=save.runs
            )
        except Exception as exc:
            self._fail_save(
                save.key,
                save.step,
                f"the batched copy failed ({cause!r}) and so did a synchronous one ({exc!r})",
            )
            return
        self._fallbacks.append("save")
        self._record_done(SAVE, keys=[save.key], nbytes=save.nbytes, began=began, step=save.step)

    # ---------------------------------------------------------- submission

    def _describe(
        self,
        batch: DescriptorBatch,
        block_ids: list[int],
        runs: Sequence[tuple[int, int]] | None,
        address: int,
        nbytes: int,
        *,
        to_region: bool,
    ) -> None:
        """Add the copy of one entry (`nbytes` at `address`, laid out over `block_ids`,
        whose runs are `runs` when known) to `batch`: one descriptor per run.

        An entry of one run is one descriptor of its `nbytes` (which fit its
        blocks: both paths check that before they get here)."""
        if runs is not None and len(runs) == 1:
            region = self._region_base + runs[0][0] * self.block_size
            if to_region:
                batch.add(address, region, nbytes)
            else:
                batch.add(region, address, nbytes)
        else:
            batch.add_entry(
                block_ids,
                region_base=self._region_base,
                block_size=self.block_size,
                other_base=address,
                nbytes=nbytes,
                to_region=to_region,
                runs=runs,
            )

    def _submit(
        self,
        batch: DescriptorBatch,
        direction: TransferDirection,
        keepalive: list[torch.Tensor],
        keys: list[str],
        tids: list[int],
    ) -> Exception | None:
        """Submit one batch and track it; on failure return the exception (never raise).

        `keepalive`, `keys` and `tids` are kept as given (the caller built them
        for this batch and does not touch them again)."""
        try:
            handle = self._submit_transfer(batch, direction, keepalive)
        except Exception as exc:
            logger.debug("EC CPU tier: batched %s failed", direction.value, exc_info=True)
            self._warnings.warn(
                f"submit-{direction.value}",
                "EC CPU tier: a batched %s of %d entries on rank %d failed (%r); copying "
                "them synchronously instead",
                direction.value,
                len(keys) + len(tids),
                self.rank_info.rank,
                exc,
            )
            return exc
        if type(handle) is CompletedTransfer:  # landed already: nothing to hold or poll
            self._inflight.add_landed(
                direction,
                self._step,
                keys=keys,
                tids=tids,
                nbytes=batch.nbytes,
                seconds=handle.seconds or 0.0,
            )
        else:
            self._inflight.add(
                Transfer(direction, handle, self._step, keys, tids, batch.nbytes, keepalive)
            )
        return None

    def _copy_entry_now(
        self,
        device: torch.Tensor,
        block_ids: list[int],
        nbytes: int,
        *,
        to_region: bool,
        runs: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Copy one entry between `device` and its blocks with `_copy_now`, run by run.

        `runs` are the entry's checked runs: the copy touches exactly the blocks
        the bounds and watermark checks passed (and a batch would touch), even
        when the ids between a run's ends disagree with them."""
        flat = device.reshape(-1).view(torch.uint8)
        spans = entry_spans(block_ids, self.block_size, nbytes, runs)
        for region_offset, entry_offset, size in spans:
            host = self._region_bytes[region_offset : region_offset + size]
            other = flat[entry_offset : entry_offset + size]
            if to_region:
                self._copy_now(host, other)
            else:
                self._copy_now(other, host)

    def _record_done(
        self,
        direction: TransferDirection,
        *,
        nbytes: int,
        began: float,
        keys: Sequence[str] = (),
        tids: Sequence[int] = (),
        step: int | None = None,
    ) -> None:
        """Record a copy that already landed, so it is reported like the batched ones."""
        self._inflight.add_landed(
            direction,
            self._step if step is None else step,
            keys=list(keys),
            tids=list(tids),
            nbytes=nbytes,
            seconds=time.perf_counter() - began,
        )

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
