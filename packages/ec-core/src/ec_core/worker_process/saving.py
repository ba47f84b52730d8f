"""The save path: encoder outputs checked, queued, and written as one batch a step."""

from __future__ import annotations

import math
import time

import torch

from ec_core._vllm import get_logger
from ec_core.metadata import ECCPUConnectorMetadata
from ec_core.region.mapping import ECSharedRegion
from ec_core.worker_process.copying import RegionCopies
from ec_core.worker_process.entries import PendingSave, save_problem
from ec_core.worker_process.transfer import SAVE, DescriptorBatch, checked_runs

logger = get_logger(__name__)


class EntrySaves(RegionCopies):
    """`save_caches`, `flush_saves` and the synchronous fallback (a part of
    `ECCPUWorker`, which states the guarantees)."""

    region: ECSharedRegion
    saves_here: bool
    _itemsize: int
    _reserved_blocks: int
    _queued: set[str]
    _pending_saves: list[PendingSave]
    _failed_saves: list[tuple[int, str]]
    _save_keys: tuple[ECCPUConnectorMetadata | None, dict[str, list[str]]]
    """The metadata whose salted saves `_save_keys_of` indexed, and that index."""

    def save_caches(
        self,
        encoder_cache: dict[str, torch.Tensor],
        mm_hash: str,
        metadata: ECCPUConnectorMetadata,
    ) -> None:
        """Queue `encoder_cache[mm_hash]` for this step's save batch, once for each
        key the scheduler asked to save it under.

        vLLM calls it once per encoder output computed in the step, with its
        identifier (`mm_hash`). The scheduler keys a save by the item's tier key,
        which is the identifier unless the item's request has a `cache_salt`
        (`metadata.identifiers` then names the identifier). Not a save rank, or
        not a save the scheduler asked for: nothing happens.
        """
        if not self.saves_here or self._closed:
            return
        if not metadata.identifiers:  # the usual step: every key is an identifier
            self._queue_save(encoder_cache, mm_hash, mm_hash, metadata)
            return
        for key in self._save_keys_of(mm_hash, metadata):
            self._queue_save(encoder_cache, mm_hash, key, metadata)

    def _save_keys_of(self, identifier: str, metadata: ECCPUConnectorMetadata) -> list[str]:
        """The keys of `metadata.saves` whose item vLLM names `identifier`."""
        indexed, index = self._save_keys
        if indexed is not metadata:
            index = {}
            names = metadata.identifiers
            for key in metadata.saves:
                index.setdefault(names.get(key, key), []).append(key)
            self._save_keys = (metadata, index)
        return index.get(identifier, [])

    def _queue_save(
        self,
        encoder_cache: dict[str, torch.Tensor],
        mm_hash: str,
        key: str,
        metadata: ECCPUConnectorMetadata,
    ) -> None:
        """Queue the save of `encoder_cache[mm_hash]` under `key` (see `save_caches`)."""
        block_ids = metadata.saves.get(key)
        if block_ids is None or key in self._queued:
            return
        source = encoder_cache.get(mm_hash)
        if source is None:
            return  # reported as failed at the end of the step
        self._queued.add(key)
        shape = metadata.save_shapes.get(key)
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
                self._fail_save(key, self._step, problem or "the scheduler sent no shape for it")
                return
        runs = checked_runs(block_ids, metadata.runs.get(key))
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
                self._fail_save(key, self._step, problem, kind="save-unreserved")
                return
        try:
            data = source.contiguous()
        except RuntimeError as exc:  # a strided output's copy found no device memory
            self._fail_save(key, self._step, f"cannot make a contiguous copy of it: {exc}")
            return
        self._pending_saves.append(PendingSave(key, self._step, data, block_ids, nbytes, runs))

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
