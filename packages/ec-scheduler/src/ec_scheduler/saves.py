"""Which computed items get a save, and into which blocks.

Runs in the scheduler process, under the scheduler's lock, from
`update_state_after_alloc`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ec_core._vllm import get_logger
from ec_core.ratelimit import RateLimitedWarnings
from ec_core.scheduler_process.allocator import BlockAllocator
from ec_scheduler.availability import num_embeds
from ec_scheduler.counters import SchedulerCounters
from ec_scheduler.step_plan import StepPlan

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec

    from ec_core.layout import RegionLayout

logger = get_logger(__name__)


class Saves:
    """Sizes a computed item's save and allocates its blocks, or skips it.

    Guarantees:
      * never raises for an item: one that cannot be saved is skipped and
        counted; a modality without a measured width, an item without
        embeddings and one larger than the region are each warned about once
        per modality; a save the policy does not admit or a region full of
        held entries is only counted;
      * a save is sized from its modality's measured width (`widths`, the
        scheduler's own dict) and the item's embedding count, and planned in
        the step's `StepPlan` with the blocks the allocator gave it.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        counters: SchedulerCounters,
        layout: RegionLayout,
        widths: dict[str, int],
        *,
        counted_by_lookup: bool,
    ) -> None:
        """`counted_by_lookup`: the engine is a consumer, whose lookups already told
        the policy of each item (`update_state_after_alloc`)."""
        self.allocator = allocator
        self.counters = counters
        self.layout = layout
        self.widths = widths
        self._itemsize = layout.dtype.itemsize
        self._counted_by_lookup = counted_by_lookup
        self._warn_once = RateLimitedWarnings(logger, period_s=math.inf).warn

    def allocate(self, feature: MultiModalFeatureSpec, plan: StepPlan, key: str) -> None:
        """Allocate a save of `feature` under its tier key `key` (`ec_scheduler.tenancy`)
        and add it to `plan`, or skip it (see the class)."""
        width = self.widths.get(feature.modality)
        if width is None:
            self.counters.saves_skipped_unmeasured += 1
            self._warn_once(
                f"unmeasured:{feature.modality}",
                "EC CPU tier: no encoder output width was measured for modality %r "
                "(measured: %s); its items are not saved",
                feature.modality,
                sorted(self.widths),
            )
            return
        rows = num_embeds(feature.mm_position)
        if rows <= 0:
            self.counters.saves_skipped_empty += 1
            self._warn_once(
                f"empty:{feature.modality}",
                "EC CPU tier: a %s item with no embeddings is not saved",
                feature.modality,
            )
            return
        layout = self.layout
        blocks = layout.blocks_for(rows, width, self._itemsize)
        if blocks > layout.num_blocks:
            self.counters.saves_skipped_oversize += 1
            self._warn_once(
                f"oversize:{feature.modality}",
                "EC CPU tier: a %s item of %d x %d needs %d blocks but the region has "
                "%d; such items are not saved (raise ec_cpu_bytes to keep them)",
                feature.modality,
                rows,
                width,
                blocks,
                layout.num_blocks,
            )
            return
        allocator = self.allocator
        if not self._counted_by_lookup:
            allocator.note_request(key)
        entry = allocator.alloc(key, blocks, (rows, width))
        if entry is None:
            if allocator.last_refusal == "admission":
                self.counters.saves_not_admitted += 1
            else:
                self.counters.saves_skipped_full += 1
            return
        plan.add_save(
            key,
            allocator.block_ids(entry),
            (rows, width),
            entry.runs,
            identifier=feature.identifier,
        )
        counters = self.counters
        counters.saves_dispatched += 1
        counters.save_rows += rows
        counters.save_bytes += rows * width * self._itemsize
