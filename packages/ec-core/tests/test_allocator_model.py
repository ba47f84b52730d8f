"""Model-based tests of the allocator against a plain reference model."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from ec_core.allocator import BlockAllocator

POOL = 64


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/ready/pin/unpin/discard/drop against a dict-of-states model.

    The model tracks, per key, its block count, readiness and pins. After every
    step: the allocator's own invariants hold (no block owned twice, free +
    owned = pool), the same keys exist in both, and any key that vanished was
    evictable (ready, unpinned) when it vanished.
    """

    keys = Bundle("keys")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(POOL)
        self.model: dict[str, tuple[int, bool, int]] = {}  # key -> (blocks, ready, pins)
        self.counter = 0
        self.runs_seen: list[int] = []

    def _free_in_model(self) -> int:
        return POOL - sum(blocks for blocks, _, _ in self.model.values())

    def _evictable_in_model(self) -> int:
        return sum(b for b, ready, pins in self.model.values() if ready and pins == 0)

    @rule(target=keys, n=st.integers(min_value=0, max_value=POOL + 4))
    def allocate(self, n: int) -> str:
        key = f"k{self.counter}"
        self.counter += 1
        expected_ok = n <= self._free_in_model() + self._evictable_in_model()
        before = dict(self.model)
        entry = self.alloc.alloc(key, n, (n, 1))
        assert (entry is not None) == expected_ok
        if entry is None:
            assert set(self.alloc_keys()) == set(before), "a failed alloc evicted something"
            return key
        self.runs_seen.append(len(entry.runs))
        vanished = set(before) - set(self.alloc_keys())
        for gone in vanished:
            _, ready, pins = before[gone]
            assert ready and pins == 0, f"evicted {gone} while not ready or pinned"
            del self.model[gone]
        self.model[key] = (n, False, 0)
        return key

    def alloc_keys(self) -> list[str]:
        return [entry.key for entry in self.alloc]

    @rule(key=keys)
    def mark_ready(self, key: str) -> None:
        if key in self.model and not self.model[key][1]:
            self.alloc.mark_ready(key)
            blocks, _, _ = self.model[key]
            self.model[key] = (blocks, True, 0)

    @rule(key=keys)
    def pin(self, key: str) -> None:
        if key in self.model and self.model[key][1]:
            self.alloc.pin(key)
            blocks, ready, pins = self.model[key]
            self.model[key] = (blocks, ready, pins + 1)

    @rule(key=keys)
    def unpin(self, key: str) -> None:
        if key in self.model and self.model[key][2] > 0:
            self.alloc.unpin(key)
            blocks, ready, pins = self.model[key]
            self.model[key] = (blocks, ready, pins - 1)

    @rule(key=consumes(keys))
    def discard_or_drop(self, key: str) -> None:
        if key not in self.model:
            return
        _, ready, pins = self.model[key]
        if not ready:
            self.alloc.discard(key)
            del self.model[key]
        elif pins == 0:
            self.alloc.drop(key)
            del self.model[key]

    @invariant()
    def matches_model(self) -> None:
        self.alloc.check()
        assert set(self.alloc_keys()) == set(self.model)
        for key, (blocks, ready, pins) in self.model.items():
            entry = self.alloc.get(key)
            assert entry is not None
            assert (entry.num_blocks, entry.ready, entry.pins) == (blocks, ready, pins)
        held = any(not ready or pins for _, ready, pins in self.model.values())
        assert self.alloc.has_held_entries() == held
        assert self.alloc.num_free_blocks == self._free_in_model()


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None
)
TestAllocatorModel = AllocatorMachine.TestCase


def test_mean_runs_per_entry_after_long_churn(capsys: pytest.CaptureFixture[str]) -> None:
    """Mixed sizes, LRU eviction, 20k allocations: report runs per entry.

    Every entry is one run while free space is contiguous; after churn some
    entries must be split. The mean is printed (it is the fragmentation
    figure the benchmarks track) and bounded loosely here.
    """
    rng = random.Random(1234)
    pool = 1 << 16
    alloc = BlockAllocator(pool)
    runs: list[int] = []
    for i in range(20_000):
        n = rng.choice((8, 16, 32, 64, 128, 256, 512, 1024))
        entry = alloc.alloc(f"e{i}", n)
        assert entry is not None
        alloc.mark_ready(entry.key)
        if i >= 2_000:  # after warm-up: the pool is full and churning
            runs.append(len(entry.runs))
    alloc.check()
    mean = sum(runs) / len(runs)
    with capsys.disabled():
        print(f"\n[allocator] mean runs per entry after churn (LRU, 2^16 blocks): {mean:.3f}")
    assert 1.0 <= mean < 3.0
