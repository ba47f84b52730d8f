"""One save or load as a worker sees it, and when it may be copied at all.

Runs in worker processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ec_core.worker_process.transfer import checked_runs


class ECCPULoadError(RuntimeError):
    """A load the scheduler promised could be performed neither batched nor synchronously.

    vLLM gathers the entry's embeddings in the same step, so the step cannot
    go on without it; the message names the entry, the backend and both causes.
    """


@dataclass(slots=True)
class PendingSave:
    """A save queued for this step's batch."""

    key: str
    step: int
    source: torch.Tensor
    block_ids: list[int]
    nbytes: int
    """The bytes of `source` (computed once: it is read on every copy path)."""
    runs: list[tuple[int, int]] | None = None
    """The runs of `block_ids` (`checked_runs`), found once (the save path checks the
    bounds on them)."""


@dataclass(slots=True)
class PlannedLoad:
    """A load of this step: its entry, blocks, shape and size in bytes."""

    key: str
    tid: int
    block_ids: list[int]
    shape: tuple[int, int]
    nbytes: int
    runs: list[tuple[int, int]]
    """The runs of `block_ids` (`checked_runs`), found once (plan_load checks the bounds
    on them)."""


def plan_load(
    key: str,
    tid: int,
    block_ids: list[int],
    shape: tuple[int, int],
    *,
    dtype: torch.dtype,
    block_size: int,
    num_blocks: int,
    backend: str,
    sent_runs: tuple[tuple[int, int], ...] | None = None,
) -> PlannedLoad:
    """The load, or ECCPULoadError if its blocks lie outside the region or are too few
    (nothing may be copied then: the copy would leave the mapping). `sent_runs` are
    the runs the metadata sent for it, if any (see `checked_runs`)."""
    rows, cols = shape
    nbytes = rows * cols * dtype.itemsize
    runs = checked_runs(block_ids, sent_runs)  # the bounds are the runs' ends
    if len(runs) == 1:
        first, count = runs[0]
        outside = first < 0 or first + count > num_blocks
    else:
        outside = False
        for first, count in runs:
            outside = outside or first < 0 or first + count > num_blocks
    if nbytes > len(block_ids) * block_size or outside:
        raise ECCPULoadError(
            f"EC CPU tier: the load of {key!r} (transfer {tid}) names {len(block_ids)} "
            f"blocks for a {rows}x{cols} entry, some outside the region's {num_blocks} "
            f"blocks or too few of them; the scheduler and this worker ({backend}) "
            "disagree about the region"
        )
    return PlannedLoad(key, tid, block_ids, (rows, cols), nbytes, runs)


def save_problem(
    source: torch.Tensor,
    shape: tuple[int, int] | None,
    block_ids: list[int],
    *,
    dtype: torch.dtype,
    block_size: int,
) -> str | None:
    """Why `source` must not be written to `block_ids`, or None if it may.

    Only a tensor of exactly the `(rows, cols)` the scheduler allocated and of
    the region's dtype is saved: it is what a load will rebuild.
    """
    if shape is None:
        return "the scheduler sent no shape for it"
    if source.dtype != dtype:
        return f"its dtype is {source.dtype} but the region holds {dtype}"
    if tuple(source.shape) != tuple(shape):
        return f"its shape is {tuple(source.shape)} but {tuple(shape)} was allocated"
    nbytes = math.prod(shape) * dtype.itemsize  # shape == source.shape, dtype the region's
    if nbytes > len(block_ids) * block_size:
        return (
            f"it holds {nbytes} bytes but {len(block_ids)} blocks of {block_size} bytes "
            "were allocated"
        )
    return None
