"""The copies between a device and the region, for loads and saves alike.

Each entry becomes one descriptor per run of consecutive blocks; each batch is
submitted once through the backend's `_submit_transfer` and tracked in flight
(`inflight.py`) until it lands; a copy the batch could not take is made
synchronously with `_copy_now`, and counted as landed the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ec_core._vllm import get_logger
from ec_core.ratelimit import RateLimitedWarnings
from ec_core.worker_process.hooks import WorkerHooks
from ec_core.worker_process.inflight import InFlight, Transfer
from ec_core.worker_process.ranks import RankInfo
from ec_core.worker_process.transfer import (
    CompletedTransfer,
    DescriptorBatch,
    TransferDirection,
    entry_spans,
)

logger = get_logger(__name__)


class RegionCopies(WorkerHooks):
    """Describing, submitting and tracking the copies of a worker's entries.

    A part of `ECCPUWorker` (ec_core.worker_process.worker), whose constructor
    sets the state below; the load and save paths (`loading.py`, `saving.py`)
    build on it.
    """

    block_size: int
    rank_info: RankInfo
    dtype: torch.dtype
    _region_base: int
    _region_bytes: torch.Tensor
    _inflight: InFlight
    _warnings: RateLimitedWarnings
    _step: int
    _closed: bool
    _fallbacks: list[str]
    """"load" or "save" for each entry copied synchronously since the last report."""

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
