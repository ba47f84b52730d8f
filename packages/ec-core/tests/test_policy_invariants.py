"""The default policy's invariants under random use (property and model-based).

Guarded here: a held entry (not ready, or pinned) is never evicted whatever
the policy ranks; the frequency sketch's memory never grows past its bound
however many distinct keys it sees; and the policy keeps no bookkeeping for a
key the allocator removed (beyond its bounded ghost lists).
"""

from __future__ import annotations

import itertools
import sys
import types
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from ec_core.policy_names import DEFAULT_POLICY
from ec_core.scheduler_process import first_sightings, frequency_sketch, policy_wtinylfu, shadows
from ec_core.scheduler_process.allocator import BlockAllocator
from ec_core.scheduler_process.frequency_sketch import _SPREAD, FrequencySketch, key_hash
from ec_core.scheduler_process.policy import make_policy
from ec_core.scheduler_process.policy_wtinylfu import WTinyLFUPolicy
from ec_core.scheduler_process.shadows import ShadowLRU, ShadowTinyLFU

POLICY_FILES = frozenset(
    module.__file__ for module in (policy_wtinylfu, frequency_sketch, shadows, first_sightings)
)
"""The default policy's code: every module a W-TinyLFU event may run lines of."""

POOL = 96


class DefaultPolicyMachine(RuleBasedStateMachine):
    """Random requests, saves, readiness, pins and removals against a model.

    The model is, per key, (blocks, ready, pins). After every step the
    allocator's own invariants hold, every key that vanished was evictable
    when it vanished, and the policy tracks exactly the allocator's entries
    (and its ghosts stay within their bounds).
    """

    keys = Bundle("keys")

    def __init__(self) -> None:
        super().__init__()
        self.policy = make_policy(DEFAULT_POLICY, POOL)
        assert isinstance(self.policy, WTinyLFUPolicy)
        self.alloc = BlockAllocator(POOL, self.policy)
        self.model: dict[str, tuple[int, bool, int]] = {}
        self.counter = 0

    @rule(target=keys, n=st.integers(min_value=0, max_value=POOL + 4), seen=st.integers(1, 3))
    def save(self, n: int, seen: int) -> str:
        key = f"k{self.counter % 40}" if self.counter % 3 else f"new{self.counter}"
        self.counter += 1
        for _ in range(seen):
            self.alloc.note_request(key)
        if key in self.model:
            return key
        before = dict(self.model)
        entry = self.alloc.alloc(key, n)
        for gone in set(before) - {e.key for e in self.alloc}:
            _, ready, pins = before[gone]
            assert ready and pins == 0, f"evicted {gone} while held"
            del self.model[gone]
        if entry is not None:
            self.model[key] = (n, False, 0)
        return key

    @rule(key=keys)
    def ready(self, key: str) -> None:
        if key in self.model and not self.model[key][1]:
            self.alloc.mark_ready(key)
            self.model[key] = (self.model[key][0], True, 0)

    @rule(key=keys)
    def pin(self, key: str) -> None:
        if key in self.model and self.model[key][1]:
            self.alloc.note_request(key)
            self.alloc.pin(key)
            blocks, ready, pins = self.model[key]
            self.model[key] = (blocks, ready, pins + 1)

    @rule(key=keys)
    def unpin(self, key: str) -> None:
        if key in self.model and self.model[key][2] > 0:
            self.alloc.unpin(key)
            blocks, ready, pins = self.model[key]
            self.model[key] = (blocks, ready, pins - 1)

    @rule(key=keys)
    def remove(self, key: str) -> None:
        if key not in self.model:
            return
        _, ready, pins = self.model[key]
        if not ready:
            self.alloc.discard(key)
        elif pins == 0:
            self.alloc.drop(key)
        else:
            return
        del self.model[key]

    @invariant()
    def consistent(self) -> None:
        self.alloc.check()
        assert {e.key for e in self.alloc} == set(self.model)
        policy = self.policy
        assert set(policy._segment) == set(self.model), "policy leaked or lost a key"
        assert set(policy._blocks) == set(self.model)
        evictable = {k for k, (_, ready, pins) in self.model.items() if ready and pins == 0}
        assert set(policy.candidates()) == evictable
        assert sum(policy.segment_blocks().values()) == sum(b for b, _, _ in self.model.values())
        ghosts = policy._refused
        assert ghosts.blocks <= ghosts.max_blocks and len(ghosts) <= ghosts.max_entries
        assert policy._trial <= set(self.model), "a trial outlived its entry"
        assert len(policy.sketch.counters) == policy.sketch.depth * policy.sketch.width
        lru, tiny = policy._lru, policy._tiny
        assert lru.used == sum(lru.order.values()) <= policy.capacity
        assert tiny.window_used == sum(tiny.window.values())
        assert tiny.main_used == sum(tiny.main.values()) <= tiny.main_capacity
        assert tiny.window_used + tiny.main_used <= policy.capacity
        assert not tiny.window.keys() & tiny.main.keys()
        if policy.recency_mode:
            assert policy.window_target == policy.capacity


TestDefaultPolicyMachine = DefaultPolicyMachine.TestCase
TestDefaultPolicyMachine.settings = settings(
    max_examples=120, stateful_step_count=60, deadline=None
)


@settings(max_examples=25, deadline=None)
@given(distinct=st.integers(1, 50_000), max_width=st.sampled_from([16, 256, 4096]))
def test_sketch_memory_is_bounded(distinct: int, max_width: int) -> None:
    sketch = FrequencySketch(1 << 20, max_width=max_width)
    bound = sketch.depth * max_width
    for i in range(distinct):
        sketch.increment(f"key{i}")
    sketch.resize(1 << 30)
    assert len(sketch.counters) <= bound
    assert all(value <= sketch.cap for value in sketch.counters)


def test_sketch_never_undercounts_before_a_reset() -> None:
    sketch = FrequencySketch(1024)
    for i in range(500):
        for _ in range(i % 5 + 1):
            sketch.increment(f"k{i}")
    assert sketch.resets == 0
    assert all(sketch.estimate(f"k{i}") >= min(i % 5 + 1, sketch.cap) for i in range(500))


def test_sketch_resize_keeps_every_count() -> None:
    """Growing or shrinking the sketch never lowers an estimate: still no undercount."""
    sketch = FrequencySketch(64, max_width=1 << 14, period_factor=1000.0)
    for i in range(300):
        for _ in range(i % 7 + 1):
            sketch.increment(f"k{i}")
    assert sketch.resets == 0
    before = [sketch.estimate(f"k{i}") for i in range(300)]
    assert all(before[i] >= i % 7 + 1 for i in range(300))
    for width in (256, 4096, 1 << 14, 512, 64):
        sketch.resize(width)
        assert sketch.width == width and len(sketch.counters) == sketch.depth * width
        assert all(sketch.estimate(f"k{i}") >= before[i] for i in range(300)), width


def test_sketch_hash_is_deterministic() -> None:
    """Estimates depend on CRC-32 of the key only (no salted `hash()`): fixed values."""
    sketch = FrequencySketch(16)
    for _ in range(3):
        sketch.increment("img7")
    assert sketch.estimate_hash(key_hash("img7")) == sketch.estimate("img7") == 3
    assert key_hash("img7") == zlib.crc32(b"img7")


@settings(max_examples=30, deadline=None)
@given(
    width=st.sampled_from([16, 32, 64, 1 << 16]),
    keys=st.lists(st.integers(0, 400), min_size=1, max_size=120),
)
def test_sketch_matches_its_documented_layout(width: int, keys: list[int]) -> None:
    """Counters and estimates equal a plain reading of the docstrings (row r's index
    is the top log2(width) bits of bits [32r, 32r + 32) of hash * _SPREAD; the least
    counters rise; the estimate is the least of four). The hot methods are written
    for speed: this pins what they compute, so the benchmarks' figures stay put."""
    sketch = FrequencySketch(width, period_factor=1000.0)
    bits = width.bit_length() - 1
    reference = [0] * (sketch.depth * width)

    def cells(key: str) -> list[int]:
        spread = key_hash(key) * _SPREAD
        fields = [(spread >> (32 * row)) & 0xFFFFFFFF for row in range(sketch.depth)]
        return [row * width + (field >> (32 - bits)) for row, field in enumerate(fields)]

    for number in keys:
        key = f"img{number}"
        least = min(reference[cell] for cell in cells(key))
        for cell in cells(key):
            if reference[cell] == least and least < sketch.cap:
                reference[cell] = least + 1
        sketch.increment(key)
    assert sketch.resets == 0
    assert list(sketch.counters) == reference
    for number in range(401):  # counted or not: narrow widths make them collide
        key = f"img{number}"
        assert sketch.estimate(key) == min(reference[cell] for cell in cells(key))


def test_sketch_ages_by_halving() -> None:
    sketch = FrequencySketch(16)
    for _ in range(12):
        sketch.increment("hot")
    before = sketch.estimate("hot")
    for i in range(sketch.period):
        sketch.increment(f"cold{i}")
    assert sketch.resets >= 1
    assert sketch.estimate("hot") <= before // 2 + 1


def _record_shadow_requests(policy: WTinyLFUPolicy) -> list[str]:
    """The keys of the requests that reach the policy's shadows, from now on (the
    caller clears the list when it likes)."""
    reached: list[str] = []
    shadow_request = policy._shadow_request

    def recording(key: str, sampled: bool) -> None:
        reached.append(key)
        shadow_request(key, sampled)

    policy._shadow_request = recording  # type: ignore[method-assign]
    return reached


def _trailing_zeros(key: str, bits: int) -> int:
    digest = zlib.crc32(key.encode())
    return min((digest & -digest).bit_length() - 1 if digest else bits, bits)


@settings(max_examples=60, deadline=None)
@given(
    trace=st.lists(st.integers(0, 80), min_size=50, max_size=400),
    batch=st.integers(1, 16),
)
def test_a_held_key_the_requests_skip_is_in_no_shadow(trace: list[int], batch: int) -> None:
    """`on_request` skips the shadows for a held key outside their hash sample whose
    blocks, times 2 to the trailing zero bits of its hash (the highest rate it was in
    the sample at), stay below `_big_blocks`: the shadows must never hold such a key,
    and every request of a key they hold must reach them. Keys are looked up `batch`
    at a time before the misses are saved (the scheduler tells the policy of each
    item right before its save; any other caller may batch), so the shadows can thin
    between a miss's lookup and the save that tells them its size (they thin often
    here: 4 entries before a halving). Distinct keys come first, one at a time, so
    the shadows thin early whatever `batch` and the trace are."""
    policy = WTinyLFUPolicy(POOL, max_shadow_entries=4)
    alloc = BlockAllocator(POOL, policy)
    reached = _record_shadow_requests(policy)
    first = [[number] for number in range(0, 80, 3)]
    for step in first + [trace[start : start + batch] for start in range(0, len(trace), batch)]:
        for number in step:
            key = f"k{number}"
            shadowed = key in policy._lru.keys() | policy._tiny.keys()
            reached.clear()
            alloc.note_request(key)
            assert not shadowed or reached, f"{key} is in a shadow, but its request skipped them"
        for number in step:
            key = f"k{number}"
            if key not in alloc and alloc.alloc(key, 1 + number * 7 % 30) is not None:
                alloc.mark_ready(key)
        bits = policy.shadow_rate_bits
        for key in policy._lru.keys() | policy._tiny.keys():
            held = policy._blocks.get(key)
            if held is not None and not policy._in_hash_sample(key):
                assert held << _trailing_zeros(key, bits) >= policy._big_blocks, key
    assert policy.shadow_rate_bits >= 1, "the shadows never thinned: the test tests nothing"


def test_a_miss_whose_save_comes_after_a_halving_is_weighed_at_the_new_rate() -> None:
    """A miss's size comes with its save; if the shadows halve their sample between
    its lookup and its save (another lookup of the step adds a shadow entry), the
    save weighs it at the new rate, so a key its hash leaves out of the new sample is
    not put in the shadows, where a later request would skip it. Each round looks
    up a miss whose hash is in the current sample and out of the next, then a held
    key that may enter the shadows and make them halve, then saves the miss."""
    policy = WTinyLFUPolicy(POOL, max_shadow_entries=4)
    alloc = BlockAllocator(POOL, policy)
    reached = _record_shadow_requests(policy)
    names = (f"k{number}" for number in itertools.count())

    def fresh(zeros: int | None = None) -> str:
        for name in names:
            if zeros is None or _trailing_zeros(name, 32) == zeros:
                return name
        raise AssertionError("unreachable")

    halved_between = 0
    for _ in range(300):
        rate = policy.shadow_rate_bits
        miss = fresh(zeros=rate)
        alloc.note_request(miss)
        held = fresh()
        if alloc.alloc(held, 1, force=True) is not None:  # saved unasked: in no shadow
            alloc.mark_ready(held)
            alloc.note_request(held)
        halved_between += policy.shadow_rate_bits > rate
        if alloc.alloc(miss, 1, force=True) is None:
            continue
        alloc.mark_ready(miss)
        shadowed = miss in policy._lru.keys() | policy._tiny.keys()
        reached.clear()
        alloc.note_request(miss)
        assert not shadowed or reached, f"{miss} is in a shadow, but its request skipped them"
    assert halved_between, "the shadows never halved between a lookup and its save"


def test_a_request_skips_the_shadows_only_for_keys_they_do_not_hold() -> None:
    """`on_request` skips the shadows' lookups for a held key outside their hash
    sample whose blocks, times 2 to the number of trailing zero bits of its hash
    (the highest rate it was in the sample at), stay below the big-item size. Sizes
    here make entries that thinning keeps outside the sample at a doubled weight
    (80 and 160 blocks reach the 312 of a 20,000-block pool over 64 after one or two
    doublings): every request of a key either shadow holds still reaches them, and
    every entry outside the sample weighs what that bound allows."""
    pool = 20_000
    policy = WTinyLFUPolicy(pool, max_shadow_entries=64)
    alloc = BlockAllocator(pool, policy)
    sizes = (10, 40, 80, 160, 400)
    reached = _record_shadow_requests(policy)
    missed = 0
    for i in range(12_000):
        number = (i * 7) % 1500 if i % 3 else i % 90  # a popular core, and a long tail
        key = f"k{number}"
        held = key in policy._lru.order or key in policy._tiny.window or key in policy._tiny.main
        reached.clear()
        alloc.note_request(key)
        missed += held and key not in reached
        if key not in alloc and alloc.alloc(key, sizes[number % len(sizes)]) is not None:
            alloc.mark_ready(key)
    assert missed == 0, "a request skipped the shadows for a key they hold"
    big, bits = policy._big_blocks, policy.shadow_rate_bits
    assert bits >= 3
    outside = 0
    for shadow in (policy._lru.order, policy._tiny.window, policy._tiny.main):
        for key, weight in shadow.items():
            blocks = sizes[int(key[1:]) % len(sizes)]
            zeros = _trailing_zeros(key, bits)
            assert weight in {blocks << rate for rate in range(zeros + 1)}, (key, weight)
            if not policy._in_hash_sample(key):
                outside += 1
                assert weight >= big and blocks << zeros >= big, (key, weight)
    assert outside, "no entry outside the sample: the case the bound is for is not exercised"


def test_policy_state_stays_bounded_over_many_keys() -> None:
    """Many distinct keys through a small pool: the per-key state is bounded."""
    policy = WTinyLFUPolicy(1000, max_ghost_entries=256, max_sketch_width=1024)
    alloc = BlockAllocator(1000, policy)
    for i in range(20_000):
        key = f"k{i}"
        alloc.note_request(key)
        alloc.note_request(key)
        entry = alloc.alloc(key, 1 + i % 50)
        if entry is not None:
            alloc.mark_ready(key)
    assert len(policy.sketch.counters) <= policy.sketch.depth * 1024
    shadows = len(policy._lru.order) + len(policy._tiny.window) + len(policy._tiny.main)
    assert policy._lru.used <= 1000 and shadows <= 2000
    assert not policy._unsized, "every request reached its save"
    assert len(policy.tracked_keys()) <= len(alloc) + 256 + shadows
    assert policy._trial <= {e.key for e in alloc}
    alloc.clear()
    assert not policy._segment and not policy._blocks and not list(policy.candidates())


def _policy_lines(policy: WTinyLFUPolicy, alloc: BlockAllocator, keys: list[str]) -> int:
    """Python lines the policy executes for requests, saves and hits of `keys`."""
    count = 0

    def tracer(frame: types.FrameType, event: str, arg: object) -> object:
        nonlocal count
        if event == "line" and frame.f_code.co_filename in POLICY_FILES:
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        for key in keys:
            alloc.note_request(key)
            entry = alloc.get(key)
            if entry is None:
                if alloc.alloc(key, 4) is not None:
                    alloc.mark_ready(key)
            elif entry.evictable:
                alloc.pin(key)
                alloc.unpin(key)
    finally:
        sys.settrace(None)
    return count


def test_per_event_cost_does_not_grow_with_entries() -> None:
    """The same 300 events cost a bounded number of lines on 100 or 20 000 entries."""
    costs = []
    for entries in (100, 20_000):
        policy = WTinyLFUPolicy(entries * 4)
        alloc = BlockAllocator(entries * 4, policy)
        for i in range(entries * 2):  # full pool, churned
            key = f"warm{i}"
            alloc.note_request(key)
            alloc.note_request(key)
            if alloc.alloc(key, 4) is not None:
                alloc.mark_ready(key)
        keys = [f"hot{i % 30}" for i in range(300)]
        costs.append(_policy_lines(policy, alloc, keys))
    small, big = costs
    assert big <= 2 * small, costs


def test_frequency_expert_duel_weighs_a_bounded_number_of_victims() -> None:
    """A large item offered to the frequency expert's main part, full of one-block
    items, is weighed against at most `max_victims` of them, not the thousands it
    would push out: a duel's cost does not grow with how small the entries are."""
    sketch = FrequencySketch(1 << 16)
    weighed: list[str] = []
    estimate = sketch.estimate

    def counting_estimate(key: str) -> int:
        weighed.append(key)
        return estimate(key)

    sketch.estimate = counting_estimate  # type: ignore[method-assign]
    shadow = ShadowTinyLFU(10_000, 0.01, sketch, max_victims=32)
    for i in range(12_000):  # main fills with one-block items, then duels begin
        sketch.increment(f"small{i}")
        shadow.insert(f"small{i}", 1)
    assert shadow.main_used == shadow.main_capacity
    weighed.clear()
    shadow._offer("large", 2_000)  # the duel a window overflow starts
    assert 0 < len(weighed) <= 32 + 1, len(weighed)  # the victims, and the candidate


def test_shadow_insert_of_a_present_key_counts_it_once() -> None:
    """Saving a key a shadow already holds replaces it: its blocks count once, and
    the frequency expert holds it in one part only."""
    lru = ShadowLRU(100)
    lru.insert("a", 10)
    lru.insert("a", 30)
    assert lru.used == sum(lru.order.values()) == 30
    sketch = FrequencySketch(1024)
    tiny = ShadowTinyLFU(100, 0.1, sketch)
    for key in ("a", "b", "c"):
        tiny.insert(key, 5)  # a overflows the 10-block window into main
    assert "a" in tiny.main
    tiny.insert("b", 5)
    tiny.insert("a", 5)
    assert not tiny.window.keys() & tiny.main.keys()
    assert tiny.window_used == sum(tiny.window.values())
    assert tiny.main_used == sum(tiny.main.values())
    assert tiny.window_used + tiny.main_used == 15
