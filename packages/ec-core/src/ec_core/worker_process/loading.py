"""The load path: every load of a step into vLLM's encoder cache before the model runs."""

from __future__ import annotations

import time

import torch

from ec_core.metadata import ECCPUConnectorMetadata
from ec_core.worker_process.copying import RegionCopies
from ec_core.worker_process.entries import ECCPULoadError, PlannedLoad, plan_load
from ec_core.worker_process.transfer import LOAD, DescriptorBatch


def _first_block_of_load(item: tuple[str, tuple[int, list[int], tuple[int, int]]]) -> int:
    """Sort key of a load: its first block (an entry without blocks first)."""
    block_ids = item[1][1]
    return block_ids[0] if block_ids else -1


class EntryLoads(RegionCopies):
    """`start_load_caches` and its synchronous fallback (a part of `ECCPUWorker`,
    which states the guarantees)."""

    _num_blocks: int
    _backend_name: str

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
        # vLLM's encoder cache holds an item under its identifier; a salted key names
        # it in `identifiers` (reports keep the key, by transfer id).
        identifiers = metadata.identifiers
        if len(loads) == 1:  # the usual step: the same as below, without the lists
            key = loads[0].key
            encoder_cache[identifiers.get(key, key) if identifiers else key] = self._load_one(
                loads[0]
            )
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
            encoder_cache[identifiers.get(load.key, load.key)] = buffer

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
