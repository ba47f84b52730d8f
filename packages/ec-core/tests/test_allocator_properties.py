"""Every policy through the allocator, under long random call sequences.

Checked after every step, for LRU, S3-LFU and W-TinyLFU alike: the allocator's
own invariants; the block-id list of every entry equals its runs; no run lies
at or above the reservation watermark (which grows in small steps while
allocations happen); `on_evict` only ever sees an entry that was ready and
unpinned; a refused `alloc` evicted nothing; the policy's candidates are
exactly the evictable entries, each once; and the policy's per-key state
(ghosts, trials, refused lists, shadows, the sketch) stays within its bounds.
After each successful `alloc`: while the order was strict (LRU, W-TinyLFU in
recency mode) the victims were among the policy's first ones (all of them,
or a window of some of them); and a split entry has no more runs than the
free space required. The phased workload alternates recency- and
frequency-friendly traffic so that W-TinyLFU changes mode several times along
the way.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ec_core.scheduler_process.allocator import BlockAllocator, Entry
from ec_core.scheduler_process.policy import EvictionPolicy, make_policy
from ec_core.scheduler_process.policy_s3lfu import S3LFUPolicy
from ec_core.scheduler_process.policy_wtinylfu import MAX_UNSIZED, WTinyLFUPolicy

POOL = 80


class Harness:
    """An allocator, a model of its entries, and the checks run after each step."""

    def __init__(self, policy: EvictionPolicy, pool: int, reserved: int) -> None:
        self.policy = policy
        self.pool = pool
        self.alloc = BlockAllocator(pool, policy, on_evict=self._evicted, reserved=reserved)
        self.order: list[str] = []
        self.strict = False
        admit = policy.admit

        def admit_and_look(key: str, num_blocks: int) -> bool:
            admitted = admit(key, num_blocks)
            self.order = list(policy.candidates())
            self.strict = policy.strict_order
            return admitted

        policy.admit = admit_and_look  # type: ignore[method-assign]
        self.watermark = reserved
        self.model: dict[str, list[int | bool]] = {}  # key -> [blocks, ready, pins]
        self.evicted: list[str] = []
        self.free_before = 0
        self.alloc_blocks: dict[str, int] = {}

    def _evicted(self, entry: Entry) -> None:
        assert entry.key not in self.alloc, "on_evict ran before the entry left"
        _, ready, pins = self.model[entry.key]
        assert ready and pins == 0, f"evicted {entry.key} while not ready or pinned"
        assert entry.ready and entry.pins == 0
        del self.model[entry.key]
        self.evicted.append(entry.key)

    # --------------------------------------------------------- operations

    def request(self, key: str) -> None:
        self.alloc.note_request(key)

    def allocate(self, key: str, n: int, force: bool) -> Entry | None:
        if key in self.alloc:
            return None
        before = set(self.model)
        evicted = len(self.evicted)
        self.free_before = self.alloc.num_free_blocks
        self.alloc_blocks = {k: int(state[0]) for k, state in self.model.items()}
        # The order (and W-TinyLFU's mode) the eviction sees: `admit` may end a
        # guard sample and change both.
        self.order = list(self.policy.candidates())
        self.strict = self.policy.strict_order
        entry = self.alloc.alloc(key, n, (n, 1), force=force)
        if entry is None:
            assert len(self.evicted) == evicted, "a refused alloc evicted something"
            assert set(self.model) == before
            if self.alloc.last_refusal == "full":
                assert n > self.alloc.num_free_blocks + self.alloc.num_evictable_blocks
            else:
                assert self.alloc.last_refusal == "admission" and not force
            return None
        assert entry.num_blocks == n and not entry.ready and entry.pins == 0
        self.model[key] = [n, False, 0]
        victims = self.evicted[evicted:]
        if self.strict and victims:
            self._check_strict(self.order, victims, entry)
        self._check_fewest_runs(entry)
        return entry

    def _check_strict(self, order: list[str], victims: list[str], entry: Entry) -> None:
        """A strict order costs only the policy's first victims (the shortest
        prefix of its order that frees enough blocks): all of them, or a window
        made of some of them, which then holds the entry in one run."""
        needed = entry.num_blocks - self.free_before
        prefix: list[str] = []
        for key in order:
            if needed <= 0:
                break
            prefix.append(key)
            needed -= self.alloc_blocks[key]
        first_victims = set(prefix)
        assert set(victims) <= first_victims, (victims, prefix, order)
        if set(victims) != first_victims:
            assert len(entry.runs) == 1, "a window was evicted, yet the entry is split"

    def _check_fewest_runs(self, entry: Entry) -> None:
        """The entry's runs are as few as the free space (before it) allowed."""
        spans = sorted(self.alloc._free.runs() + list(entry.runs))
        merged: list[list[int]] = []
        for start, length in spans:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1][1] += length
            else:
                merged.append([start, length])
        lengths = sorted((length for _, length in merged), reverse=True)
        need, fewest = entry.num_blocks, 0
        while need > 0:
            need -= lengths[fewest]
            fewest += 1
        assert len(entry.runs) == fewest, (entry.runs, merged)

    def ready(self, key: str) -> None:
        state = self.model.get(key)
        if state is not None and not state[1]:
            self.alloc.mark_ready(key)
            state[1] = True

    def pin(self, key: str) -> None:
        state = self.model.get(key)
        if state is not None and state[1]:
            self.alloc.pin(key)
            state[2] = int(state[2]) + 1

    def unpin(self, key: str) -> None:
        state = self.model.get(key)
        if state is not None and int(state[2]) > 0:
            self.alloc.unpin(key)
            state[2] = int(state[2]) - 1

    def remove(self, key: str) -> None:
        state = self.model.get(key)
        if state is None:
            return
        if not state[1]:
            self.alloc.discard(key)
        elif state[2] == 0:
            self.alloc.drop(key)
        else:
            return
        del self.model[key]

    def extend(self, to: int) -> None:
        added = self.alloc.extend_reserved(to)
        expected = max(self.watermark, min(to, self.pool))
        assert added == expected - self.watermark
        self.watermark = expected

    def clear(self) -> None:
        self.alloc.clear()
        self.model.clear()

    # ------------------------------------------------------------- checks

    def check(self) -> None:
        alloc = self.alloc
        alloc.check()
        assert alloc.num_reserved_blocks == self.watermark
        assert {e.key for e in alloc} == set(self.model)
        owned = 0
        for entry in alloc:
            blocks, ready, pins = self.model[entry.key]
            assert (entry.num_blocks, entry.ready, entry.pins) == (blocks, ready, pins)
            expected = [b for start, length in entry.runs for b in range(start, start + length)]
            assert entry.block_ids == expected
            assert alloc.block_ids(entry) == expected
            assert all(start + length <= self.watermark for start, length in entry.runs)
            assert all(length > 0 for _, length in entry.runs)
            owned += entry.num_blocks
        assert alloc.num_free_blocks + owned == self.watermark
        evictable = {k for k, (_, ready, pins) in self.model.items() if ready and pins == 0}
        candidates = list(self.policy.candidates())
        assert len(candidates) == len(set(candidates)), "a candidate is named twice"
        assert set(candidates) == evictable, (set(candidates) ^ evictable, self.policy.name)
        if isinstance(self.policy, WTinyLFUPolicy):
            self._check_wtinylfu(self.policy)
        elif isinstance(self.policy, S3LFUPolicy):
            self._check_s3lfu(self.policy)

    def _check_wtinylfu(self, policy: WTinyLFUPolicy) -> None:
        keys = set(self.model)
        assert set(policy._segment) == keys and set(policy._blocks) == keys
        for segment in range(3):
            members = [k for k, s in policy._segment.items() if s == segment]
            assert policy._bytes[segment] == sum(policy._blocks[k] for k in members)
            assert set(policy.evictable_in(segment)) <= set(members)
        main = {k for k, s in policy._segment.items() if s == 1}
        assert set(policy._count) == main, "every main entry, and only those, has a count"
        for count, bucket in enumerate(policy._buckets):
            assert all(policy._count[k] == count for k in bucket), "an entry in the wrong bucket"
            assert policy._bucket_blocks[count] == sum(policy._blocks[k] for k in bucket)
        assert policy._used == sum(policy._blocks.values())
        ghosts = policy._refused
        assert ghosts.blocks == sum(ghosts.sizes.values())
        assert ghosts.blocks <= ghosts.max_blocks and len(ghosts) <= ghosts.max_entries
        assert policy._trial <= keys, "a trial outlived its entry"
        sketch = policy.sketch
        assert len(sketch.counters) == sketch.depth * sketch.width
        assert sketch.width <= sketch.max_width
        lru, tiny = policy._lru, policy._tiny
        assert lru.used == sum(lru.order.values()) <= policy.capacity
        assert tiny.window_used == sum(tiny.window.values())
        assert tiny.main_used == sum(tiny.main.values()) <= tiny.main_capacity
        assert not tiny.window.keys() & tiny.main.keys()
        assert len(policy._unsized) <= MAX_UNSIZED
        assert not policy._unsized.keys() & policy._segment.keys(), "a held key waits for its size"
        bound = len(keys) + policy.max_ghost_entries + 2 * policy.capacity + MAX_UNSIZED
        assert len(policy.tracked_keys()) <= bound
        assert policy.initial_window <= policy.window_target <= policy.capacity
        if policy.recency_mode:
            assert policy.window_target == policy.capacity

    def _check_s3lfu(self, policy: S3LFUPolicy) -> None:
        keys = set(self.model)
        assert set(policy._blocks) == keys
        assert policy._in_small <= keys
        assert policy._small_blocks == sum(policy._blocks[k] for k in policy._in_small)
        assert len(policy._ghost) <= policy.ghost_entries
        assert policy._trial <= keys, "a trial outlived its entry"
        assert set(policy._main_key) == {key for _, _, key in policy._main}
        assert len(policy._history.counts) <= policy._history.limit


class PolicyMachine(RuleBasedStateMachine):
    """Random operations over a small key space (so keys recur, hit ghosts and
    build frequency), with the watermark starting low and growing in steps."""

    POLICY = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(make_policy(self.POLICY, POOL), POOL, reserved=POOL // 4)

    @rule(
        k=st.integers(0, 29),
        n=st.integers(0, POOL + 2),
        force=st.booleans(),
        seen=st.integers(0, 3),
    )
    def save(self, k: int, n: int, force: bool, seen: int) -> None:
        key = f"k{k}"
        for _ in range(seen):
            self.h.request(key)
        self.h.allocate(key, n, force)

    @rule(k=st.integers(0, 29))
    def request(self, k: int) -> None:
        self.h.request(f"k{k}")

    @rule(k=st.integers(0, 29))
    def ready(self, k: int) -> None:
        self.h.ready(f"k{k}")

    @rule(k=st.integers(0, 29), request=st.booleans())
    def pin(self, k: int, request: bool) -> None:
        if request:
            self.h.request(f"k{k}")
        self.h.pin(f"k{k}")

    @rule(k=st.integers(0, 29))
    def unpin(self, k: int) -> None:
        self.h.unpin(f"k{k}")

    @rule(k=st.integers(0, 29))
    def remove(self, k: int) -> None:
        self.h.remove(f"k{k}")

    @rule(step=st.integers(-2, 12))
    def extend(self, step: int) -> None:
        self.h.extend(self.h.watermark + step)

    @rule()
    def clear(self) -> None:
        self.h.clear()

    @invariant()
    def holds(self) -> None:
        self.h.check()


class S3LFUMachine(PolicyMachine):
    POLICY = "s3lfu"


class WTinyLFUMachine(PolicyMachine):
    POLICY = "wtinylfu"


_settings = settings(max_examples=100, stateful_step_count=100, deadline=None, derandomize=True)
TestLRUProperties = PolicyMachine.TestCase
TestLRUProperties.settings = _settings
TestS3LFUProperties = S3LFUMachine.TestCase
TestS3LFUProperties.settings = _settings
TestWTinyLFUProperties = WTinyLFUMachine.TestCase
TestWTinyLFUProperties.settings = _settings


def _phased_workload(h: Harness, rng: random.Random, steps: int) -> None:
    """Alternate recency-friendly phases (a sliding working set) with
    frequency-friendly ones (a fixed hot set among one-offs); pins, forced saves,
    drops and watermark steps mixed in. W-TinyLFU's mode is also turned over at
    every change of phase, besides whatever its guard does (on a pool this small
    the guard may keep one mode for a whole seed's run)."""
    recent: list[str] = []
    hot = [f"hot{i}" for i in range(12)]
    sizes: dict[str, int] = {}
    pinned: list[str] = []
    fresh = 0
    for step in range(steps):
        phase = (step // 700) % 2
        if step and step % 700 == 0 and isinstance(h.policy, WTinyLFUPolicy):
            h.policy._set_recency_mode(not h.policy.recency_mode)
        if phase == 0:  # recency: mostly re-use of the last few dozen keys
            if recent and rng.random() < 0.75:
                key = recent[-1 - min(int(rng.expovariate(1 / 8)), len(recent) - 1)]
            else:
                key = f"r{fresh}"
                fresh += 1
        else:  # frequency: a hot set, plus a stream of one-offs
            if rng.random() < 0.5:
                key = rng.choice(hot)
            else:
                key = f"once{fresh}"
                fresh += 1
        recent.append(key)
        del recent[:-200]
        size = sizes.setdefault(key, rng.choice((0, 1, 1, 2, 3, 5, 8, 13, h.pool // 2, h.pool)))
        h.request(key)
        state = h.model.get(key)
        if state is None:
            h.allocate(key, size, force=rng.random() < 0.2)
            if key in h.model and rng.random() < 0.9:
                h.ready(key)
        elif state[1] and rng.random() < 0.5:
            h.pin(key)
            pinned.append(key)
        roll = rng.random()
        if pinned and roll < 0.4:
            h.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif roll < 0.45:
            h.ready(rng.choice(recent))
        elif roll < 0.47:
            h.remove(rng.choice(recent))
        elif roll < 0.48:
            h.extend(h.watermark + rng.randrange(1, 4))
        h.check()


@pytest.mark.parametrize("policy", ["lru", "s3lfu", "wtinylfu"])
@pytest.mark.parametrize("seed", [0, 1])
def test_phased_workloads_keep_every_invariant(policy: str, seed: int) -> None:
    pool = 48
    h = Harness(make_policy(policy, pool), pool, reserved=8)
    if isinstance(h.policy, WTinyLFUPolicy):
        h.policy._set_recency_mode(False)  # (it starts as LRU; start it on the other side)
    _phased_workload(h, random.Random(seed), 6000)
