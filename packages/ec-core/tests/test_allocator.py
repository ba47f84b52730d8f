"""Free extents, eviction policy and the block allocator."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ec_core.scheduler_process.allocator import AllocatorError, BlockAllocator, Entry
from ec_core.scheduler_process.extents import FreeExtents
from ec_core.scheduler_process.policy import EvictionPolicy
from ec_core.scheduler_process.policy_lru import LRUPolicy
from ectools.policies import WindowLRU


def test_free_extents_merge_neighbours() -> None:
    free = FreeExtents(10)
    assert free.take_contiguous(3) == (0, 3)
    assert free.take_contiguous(3) == (3, 3)
    assert free.take_contiguous(4) == (6, 4)
    assert free.total == 0 and free.runs() == []
    free.release(3, 3)
    free.release(0, 3)
    free.release(6, 4)
    free.check()
    assert free.runs() == [(0, 10)]


def test_free_extents_best_fit_keeps_long_runs() -> None:
    free = FreeExtents(20)
    for _ in range(10):
        free.take_contiguous(2)
    free.release(0, 2)  # run of 2
    free.release(6, 6)  # run of 6
    assert free.take_contiguous(2) == (0, 2)  # the short run, not the long one
    assert max(length for _, length in free.runs()) == 6
    assert free.take_contiguous(7) is None
    free.check()


def test_free_extents_scattered_takes_fewest_pieces() -> None:
    free = FreeExtents(12)
    assert free.take_contiguous(12) == (0, 12)
    free.release(0, 1)
    free.release(3, 4)
    free.release(9, 2)
    assert free.take_scattered(6) == [(3, 4), (9, 2)]
    assert free.runs() == [(0, 1)]
    with pytest.raises(ValueError, match="only 1 are free"):
        free.take_scattered(2)
    free.check()


def test_free_extents_take_from_carves_the_named_run_only() -> None:
    free = FreeExtents(12)
    assert free.take_contiguous(12) == (0, 12)
    free.release(2, 5)
    free.release(9, 3)
    assert free.take_from(2, 3) == (2, 3)
    assert free.runs() == [(5, 2), (9, 3)]
    assert free.take_from(9, 3) == (9, 3)
    assert free.runs() == [(5, 2)]
    with pytest.raises(ValueError, match="holds 2 blocks"):
        free.take_from(5, 3)
    with pytest.raises(KeyError):
        free.take_from(6, 1)
    assert free.runs() == [(5, 2)], "a refused take changes nothing"
    free.check()


def test_the_victim_that_opens_a_run_is_carved_where_it_was() -> None:
    alloc = BlockAllocator(12, WindowLRU())
    for key in ("a", "b", "c"):
        assert alloc.alloc(key, 4) is not None
        alloc.mark_ready(key)
    alloc.drop("c")  # free: [8, 12)
    # "a" is the LRU victim; 6 blocks fit nowhere free, and "a"'s run alone is
    # too short, so the window search decides; "b" then frees [4, 12) with "c"'s space.
    entry = alloc.alloc("d", 6)
    assert entry is not None and len(entry.runs) == 1
    assert alloc.get("a") is not None and alloc.get("b") is None
    alloc.check()
    # Same size as the victim: the fast path carves the victim's own run.
    assert alloc.alloc("e", 2) is not None  # the free tail
    alloc.mark_ready("d")
    alloc.mark_ready("e")
    first = next(alloc.policy.candidates())
    victim = alloc.get(first)
    assert victim is not None
    again = alloc.alloc("f", victim.num_blocks)
    assert again is not None and again.runs == victim.runs
    alloc.check()


def test_a_strict_order_evicts_the_first_victims_and_splits_the_entry() -> None:
    # The same pool as above with plain LRU, whose order is strict: "a" goes, not
    # "b" (younger) for the sake of one run, and "d" lies in two runs.
    alloc = BlockAllocator(12)
    assert alloc.policy.strict_order
    for key in ("a", "b", "c"):
        assert alloc.alloc(key, 4) is not None
        alloc.mark_ready(key)
    alloc.drop("c")  # free: [8, 12)
    entry = alloc.alloc("d", 6)
    assert entry is not None and sorted(entry.runs) == list(entry.runs)
    assert len(entry.runs) == 2 and entry.num_blocks == 6
    assert alloc.get("a") is None and alloc.get("b") is not None
    assert len(alloc.block_ids(entry)) == 6
    alloc.check()


def _lru_pool(blocks: int, layout: tuple[tuple[str, int], ...], order: str) -> BlockAllocator:
    """A plain-LRU pool holding `layout`'s entries in address order, made ready in
    `order` (LRU's victim order)."""
    alloc = BlockAllocator(blocks)
    for key, n in layout:
        assert alloc.alloc(key, n) is not None
    for key in order:
        alloc.mark_ready(key)
    return alloc


def test_a_strict_order_takes_a_window_of_its_own_victims_only() -> None:
    # Layout a(2) c(2) b(6) d(2), LRU order a, b, c, d. Four blocks: the policy's
    # victims are a and b. The window a + c, [0, 4), would be one run at the
    # price of c, which LRU ranks after b: refused. b alone, [4, 10), is a
    # window of the policy's victims: taken, and a stays (one run, fewer
    # blocks evicted than both victims, nobody younger lost).
    alloc = _lru_pool(12, (("a", 2), ("c", 2), ("b", 6), ("d", 2)), "abcd")
    entry = alloc.alloc("x", 4)
    assert entry is not None and len(entry.runs) == 1
    assert [key for key in "abcd" if alloc.get(key) is not None] == ["a", "c", "d"]
    alloc.check()


def test_a_strict_order_never_evicts_a_younger_entry_for_one_run() -> None:
    # Layout a(10) c(5) b(10) d(5), LRU order a, b, d, c (c was used last).
    # Fifteen blocks: the victims are a and b, whose runs are apart. The window
    # a + c is one run and, weighed by rank, costs what a + b cost (10 x 1 +
    # 5 x 4 = 10 x 1 + 10 x 2); it would evict c, the most recently used. The
    # entry takes a's and b's blocks in two runs instead (issue 36: the sweep's
    # sessions trace at 10 %, heavy sizes, all in LRU order, 0.954 -> 1.000 x
    # plain LRU).
    alloc = _lru_pool(30, (("a", 10), ("c", 5), ("b", 10), ("d", 5)), "abdc")
    entry = alloc.alloc("x", 15)
    assert entry is not None and len(entry.runs) == 2
    assert [key for key in "abcd" if alloc.get(key) is not None] == ["c", "d"]
    alloc.check()


def test_a_strict_order_uses_free_pieces_before_evicting_anyone() -> None:
    # Free blocks add up to the request but lie in pieces: nobody is evicted,
    # the entry takes the pieces (a hit ratio over fewer runs, issue 36).
    alloc = BlockAllocator(16)
    for key in "abcdefgh":
        assert alloc.alloc(key, 2) is not None
        alloc.mark_ready(key)
    for key in ("b", "d", "f"):
        alloc.drop(key)  # free: [2, 4), [6, 8), [10, 12)
    entry = alloc.alloc("x", 6)
    assert entry is not None
    assert all(alloc.get(key) is not None for key in "aceg")
    assert sorted(entry.runs) == [(2, 2), (6, 2), (10, 2)]
    alloc.check()


def test_an_entrys_block_id_list_is_made_once() -> None:
    alloc = BlockAllocator(64)
    entry = alloc.alloc("k", 9)
    assert entry is not None
    ids = alloc.block_ids(entry)
    assert ids == list(range(9)) == entry.block_ids
    assert alloc.block_ids(entry) is ids, "every save and load of an entry shares its list"


def test_alloc_returns_one_ascending_run() -> None:
    alloc = BlockAllocator(16)
    a = alloc.alloc("a", 5, (5, 8))
    b = alloc.alloc("b", 3)
    assert a is not None and b is not None
    assert a.block_ids == [0, 1, 2, 3, 4]
    assert a.runs == ((0, 5),)
    assert b.block_ids == [5, 6, 7]
    assert a.shape == (5, 8)
    assert not a.ready and not a.evictable
    alloc.check()


def test_alloc_zero_blocks_is_legal() -> None:
    alloc = BlockAllocator(4)
    entry = alloc.alloc("empty", 0)
    assert entry is not None
    assert entry.runs == () and entry.block_ids == [] and entry.num_blocks == 0
    alloc.mark_ready("empty")
    alloc.pin("empty")
    alloc.unpin("empty")
    alloc.check()


def test_alloc_larger_than_pool_returns_none_without_evicting() -> None:
    alloc = BlockAllocator(8)
    alloc.alloc("a", 4)
    alloc.mark_ready("a")
    assert alloc.alloc("huge", 9) is None
    assert "a" in alloc and alloc.evictions == 0
    alloc.check()


def test_alloc_fails_fast_when_held_entries_block_it() -> None:
    alloc = BlockAllocator(8)
    alloc.alloc("ready", 3)
    alloc.mark_ready("ready")
    alloc.alloc("pending", 4)  # not ready: not evictable
    assert alloc.alloc("x", 5) is None  # 1 free + 3 evictable < 5
    assert "ready" in alloc and alloc.evictions == 0
    alloc.check()


def test_duplicate_and_negative_alloc_are_errors() -> None:
    alloc = BlockAllocator(8)
    alloc.alloc("a", 1)
    with pytest.raises(AllocatorError, match="already exists"):
        alloc.alloc("a", 1)
    with pytest.raises(ValueError, match="cannot allocate -1"):
        alloc.alloc("b", -1)


def test_state_machine_errors() -> None:
    alloc = BlockAllocator(8)
    alloc.alloc("a", 2)
    with pytest.raises(AllocatorError, match="not ready"):
        alloc.pin("a")
    with pytest.raises(AllocatorError, match="not evictable"):
        alloc.drop("a")
    alloc.mark_ready("a")
    with pytest.raises(AllocatorError, match="already ready"):
        alloc.mark_ready("a")
    with pytest.raises(AllocatorError, match="not pinned"):
        alloc.unpin("a")
    with pytest.raises(AllocatorError, match="use drop"):
        alloc.discard("a")
    with pytest.raises(KeyError):
        alloc.mark_ready("missing")


def test_nested_pins_hold_until_the_last_unpin() -> None:
    alloc = BlockAllocator(4)
    alloc.alloc("a", 2)
    alloc.mark_ready("a")
    alloc.pin("a")
    alloc.pin("a")
    assert alloc.has_held_entries()
    alloc.alloc("b", 2)
    alloc.mark_ready("b")
    alloc.unpin("a")
    assert alloc.alloc("c", 2) is not None  # evicts b, the only evictable entry
    assert "a" in alloc and "b" not in alloc
    alloc.unpin("a")
    assert alloc.get("a") is not None and alloc.get("a").evictable  # type: ignore[union-attr]
    alloc.check()


def test_lru_eviction_order_and_refresh_on_unpin() -> None:
    evicted: list[str] = []
    alloc = BlockAllocator(6, on_evict=lambda e: evicted.append(e.key))
    for key in "abc":
        alloc.alloc(key, 2)
        alloc.mark_ready(key)
    alloc.pin("a")
    alloc.unpin("a")  # a is now the most recently used
    alloc.alloc("d", 2)
    alloc.alloc("e", 2)
    assert evicted == ["b", "c"]
    assert alloc.evictions == 2
    alloc.check()


def test_has_held_entries_tracks_not_ready_and_pinned() -> None:
    alloc = BlockAllocator(4)
    assert not alloc.has_held_entries()
    alloc.alloc("a", 1)
    assert alloc.has_held_entries()
    alloc.mark_ready("a")
    assert not alloc.has_held_entries()
    alloc.pin("a")
    assert alloc.has_held_entries()
    alloc.unpin("a")
    assert not alloc.has_held_entries()
    alloc.alloc("b", 1)
    alloc.discard("b")
    assert not alloc.has_held_entries()


def test_discard_and_drop_free_their_blocks() -> None:
    alloc = BlockAllocator(4)
    alloc.alloc("a", 2)
    alloc.alloc("b", 2)
    alloc.discard("a")
    alloc.mark_ready("b")
    alloc.drop("b")
    assert alloc.num_free_blocks == 4 and len(alloc) == 0
    assert alloc.num_free_runs == 1
    alloc.check()


def test_fragmented_pool_falls_back_to_several_runs() -> None:
    alloc = BlockAllocator(10)
    for key in "abcde":
        alloc.alloc(key, 2)
    alloc.discard("b")
    alloc.discard("d")
    entry = alloc.alloc("x", 4)
    assert entry is not None
    assert entry.runs == ((2, 2), (6, 2))
    assert entry.block_ids == [2, 3, 6, 7]
    alloc.check()


def test_eviction_prefers_single_run_when_one_exists() -> None:
    alloc = BlockAllocator(8)
    alloc.alloc("a", 3)
    alloc.alloc("b", 5)
    alloc.discard("a")
    entry = alloc.alloc("c", 2)
    assert entry is not None and entry.runs == ((0, 2),)


class _RoguePolicy(LRUPolicy):
    name = "rogue"

    def candidates(self) -> Iterator[str]:
        yield "pinned"


def test_a_policy_cannot_evict_pinned_entries() -> None:
    policy = _RoguePolicy()
    assert isinstance(policy, EvictionPolicy)
    alloc = BlockAllocator(4, policy)
    alloc.alloc("pinned", 2)
    alloc.mark_ready("pinned")
    alloc.pin("pinned")
    alloc.alloc("other", 1)
    alloc.mark_ready("other")
    with pytest.raises(AllocatorError, match="not evictable"):
        alloc.alloc("new", 2)
    assert alloc.get("pinned") is not None


def test_clear_frees_everything() -> None:
    alloc = BlockAllocator(5)
    alloc.alloc("a", 2)
    alloc.alloc("b", 3)
    alloc.mark_ready("b")
    alloc.clear()
    assert len(alloc) == 0 and alloc.num_free_blocks == 5
    assert list(alloc.policy.candidates()) == []
    alloc.check()


def test_entry_block_ids_follow_runs() -> None:
    entry = Entry(key="k", runs=((4, 2), (10, 1)), num_blocks=3)
    assert entry.block_ids == [4, 5, 10]


def test_million_block_pool_costs_no_per_block_work() -> None:
    # One run describes the whole pool; allocating and freeing big entries
    # touches only run records (a per-block structure would need ~10^6 items).
    alloc = BlockAllocator(1 << 20)
    entry = alloc.alloc("big", (1 << 20) - 1)
    assert entry is not None and entry.runs == ((0, (1 << 20) - 1),)
    alloc.mark_ready("big")
    assert alloc.alloc("x", 2) is not None
    assert alloc.num_free_runs == 1
    alloc.check()


def _fill_with_one_block_entries(alloc: BlockAllocator, count: int) -> None:
    """Saves `count` ready one-block entries `small0`, `small1`, ..., each asked
    for twice first so that an admitting policy keeps it."""
    for i in range(count):
        key = f"small{i}"
        alloc.note_request(key)
        alloc.note_request(key)
        assert alloc.alloc(key, 1) is not None
        alloc.mark_ready(key)


def test_a_window_of_many_victims_costs_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Growing a window over k neighbours compares entries O(k) times, not O(k^2).

    A 1000-block item in a pool of one-block entries, under a policy that lets
    the allocator take a window (`strict_order` False): the window search once
    tested whether each neighbour was already a victim by scanning the victim
    list, seconds of scheduler time for a few thousand victims.
    """
    from ec_core.scheduler_process import allocator as allocator_module
    from ec_core.scheduler_process.policy_s3lfu import S3LFUPolicy

    comparisons = 0

    class CountingEntry(Entry):
        __slots__ = ()
        __hash__ = object.__hash__

        def __eq__(self, other: object) -> bool:
            nonlocal comparisons
            comparisons += 1
            return self is other

    monkeypatch.setattr(allocator_module, "Entry", CountingEntry)
    k = 1000
    alloc = BlockAllocator(2 * k, S3LFUPolicy(2 * k))
    _fill_with_one_block_entries(alloc, 2 * k)
    alloc.note_request("big")
    alloc.note_request("big")
    comparisons = 0
    entry = alloc.alloc("big", k)
    assert entry is not None and entry.runs == ((entry.runs[0][0], k),)
    assert alloc.evictions == k
    assert comparisons <= 4 * k, comparisons
    alloc.check()


def test_a_window_search_for_a_huge_entry_grows_one_window_not_one_per_seed() -> None:
    """A 1000-block item in a full pool of one-block entries: every one of the
    WINDOW_CANDIDATES seeds could grow a window of ~1000 members, each costing about
    as much as the others. Once one window was found, all seeds together take at most
    WINDOW_STEPS more steps, so the search costs about one window plus that bound
    (it was one full window per seed: 32 000 steps here, seconds for larger items)."""
    from ec_core.scheduler_process.allocator import WINDOW_STEPS
    from ec_core.scheduler_process.policy_s3lfu import S3LFUPolicy

    lookups = 0

    class CountingDict(dict[int, Entry]):
        def get(self, key: int, default: object = None) -> object:  # type: ignore[override]
            nonlocal lookups
            lookups += 1
            return super().get(key, default)

    k = 1000
    alloc = BlockAllocator(8 * k, S3LFUPolicy(8 * k))
    alloc._run_ending = CountingDict()
    _fill_with_one_block_entries(alloc, 8 * k)
    alloc.note_request("big")
    alloc.note_request("big")
    lookups = 0
    entry = alloc.alloc("big", k)
    assert entry is not None and len(entry.runs) == 1 and alloc.evictions == k
    assert lookups <= k + WINDOW_STEPS + 64, lookups  # a neighbour lookup per step
    alloc.check()
