"""The allocator over a pool reserved from the front as the region's reservation
advances (`BlockAllocator(reserved=...)`, `extend_reserved`): it never hands
out a block at or above the watermark, whatever the call sequence."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from ec_core.scheduler_process.allocator import BlockAllocator
from ec_core.scheduler_process.policy import make_policy

POOL = 96


class ReservedAllocatorMachine(RuleBasedStateMachine):
    """Random alloc/ready/pin/unpin/discard/drop/clear interleaved with watermark moves.

    After every step: the allocator's own invariants hold (free + owned =
    the reserved prefix), no owned block is at or above the watermark, the
    watermark never went down, and the free blocks are exactly the reserved
    blocks nobody owns.
    """

    keys = Bundle("keys")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(POOL, make_policy("lru", POOL), reserved=0)
        self.watermark = 0
        self.counter = 0

    @rule(to=st.integers(min_value=-8, max_value=POOL + 8))
    def extend(self, to: int) -> None:
        added = self.alloc.extend_reserved(to)
        expected = max(self.watermark, min(to, POOL))
        assert added == expected - self.watermark
        self.watermark = expected

    @rule(target=keys, n=st.integers(min_value=0, max_value=POOL // 3), force=st.booleans())
    def allocate(self, n: int, force: bool) -> str:
        key = f"k{self.counter}"
        self.counter += 1
        entry = self.alloc.alloc(key, n, force=force)
        if entry is not None:
            assert entry.num_blocks == n
            assert all(block < self.watermark for block in entry.block_ids)
        elif self.alloc.last_refusal == "full":
            assert n > self.alloc.num_free_blocks + self.alloc.num_evictable_blocks
        return key

    @rule(key=keys)
    def ready(self, key: str) -> None:
        entry = self.alloc.get(key)
        if entry is not None and not entry.ready:
            self.alloc.mark_ready(key)

    @rule(key=keys)
    def pin(self, key: str) -> None:
        entry = self.alloc.get(key)
        if entry is not None and entry.ready:
            self.alloc.pin(key)

    @rule(key=keys)
    def unpin(self, key: str) -> None:
        entry = self.alloc.get(key)
        if entry is not None and entry.pins > 0:
            self.alloc.unpin(key)

    @rule(key=consumes(keys))
    def remove(self, key: str) -> None:
        entry = self.alloc.get(key)
        if entry is None:
            return
        if not entry.ready:
            self.alloc.discard(key)
        elif entry.evictable:
            self.alloc.drop(key)

    @rule()
    def clear(self) -> None:
        self.alloc.clear()
        assert self.alloc.num_free_blocks == self.watermark

    @invariant()
    def never_beyond_the_watermark(self) -> None:
        self.alloc.check()
        assert self.alloc.num_reserved_blocks == self.watermark
        owned = 0
        for entry in self.alloc:
            owned += entry.num_blocks
            for start, length in entry.runs:
                assert start + length <= self.watermark, "a block above the watermark is owned"
        assert self.alloc.num_free_blocks + owned == self.watermark


TestReservedAllocator = ReservedAllocatorMachine.TestCase
TestReservedAllocator.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_the_default_is_the_whole_pool() -> None:
    alloc = BlockAllocator(8)
    assert alloc.num_reserved_blocks == 8 and alloc.num_free_blocks == 8
    assert alloc.extend_reserved(100) == 0


def test_new_blocks_merge_with_a_free_run_ending_at_the_watermark() -> None:
    alloc = BlockAllocator(16, reserved=4)
    assert alloc.alloc("a", 2) is not None
    assert alloc.extend_reserved(16) == 12
    assert alloc.num_free_runs == 1, "the old tail and the new blocks form one run"
    entry = alloc.alloc("b", 14)
    assert entry is not None and entry.runs == ((2, 14),)
    alloc.check()


def test_an_entry_larger_than_the_reserved_part_is_refused_until_it_grows() -> None:
    alloc = BlockAllocator(16, reserved=4)
    assert alloc.alloc("big", 8) is None and alloc.last_refusal == "full"
    alloc.extend_reserved(8)
    assert alloc.alloc("big", 8) is not None


@pytest.mark.parametrize("reserved", [-1, 17])
def test_a_watermark_outside_the_pool_is_rejected(reserved: int) -> None:
    with pytest.raises(ValueError, match="reserved"):
        BlockAllocator(16, reserved=reserved)
