"""The block-id pool: the lists the metadata carries, made from shared int objects."""

from __future__ import annotations

import random

import pytest

from ec_core.scheduler_process.allocator import BlockAllocator, Entry
from ec_core.scheduler_process.block_ids import CHUNK_BITS, MAX_KEPT, BlockIdPool

CHUNK = 1 << CHUNK_BITS


def test_spans_and_runs_equal_the_plain_lists_across_chunk_edges() -> None:
    pool = BlockIdPool(3 * CHUNK + 17)
    rng = random.Random(7)
    cases = [(0, 0), (0, 1), (CHUNK - 1, 2), (CHUNK - 5, 2 * CHUNK + 9), (3 * CHUNK, 17)]
    cases += [(s, rng.randrange(0, 3 * CHUNK + 17 - s)) for s in rng.sample(range(3 * CHUNK), 50)]
    for start, length in cases:
        assert pool.span(start, length) == list(range(start, start + length))
    runs = ((5, 3), (CHUNK - 2, 4), (2 * CHUNK + 1, 1))
    assert pool.ids(runs) == [i for s, n in runs for i in range(s, s + n)]
    assert pool.ids(()) == []


def test_every_list_is_new_and_chunks_are_made_only_when_named() -> None:
    pool = BlockIdPool(4 * CHUNK)
    assert pool.num_chunks_made == 0
    first = pool.span(10, 5)
    first.append(-1)  # the caller owns what it got
    assert pool.span(10, 5) == [10, 11, 12, 13, 14]
    assert pool.num_chunks_made == 1
    pool.span(3 * CHUNK, 1)
    assert pool.num_chunks_made == 2, "memory grows with the chunks named, not the region"


@pytest.mark.parametrize(("start", "length"), [(-1, 2), (0, 11), (10, 1), (3, -1)])
def test_a_span_outside_the_region_is_refused(start: int, length: int) -> None:
    with pytest.raises(IndexError):
        BlockIdPool(10).span(start, length)


def test_the_allocator_hands_out_the_entrys_block_ids() -> None:
    alloc = BlockAllocator(42)  # six entries of 7 fill it
    entries: list[Entry] = []
    for i in range(6):
        entry = alloc.alloc(f"k{i}", 7)
        assert entry is not None
        entries.append(entry)
    for entry in entries[::2]:
        alloc.discard(entry.key)
    scattered = alloc.alloc("wide", 20)  # fits in no free run: several runs
    assert scattered is not None and len(scattered.runs) > 1
    for entry in [*entries[1::2], scattered]:
        assert alloc.block_ids(entry) == entry.block_ids


def test_a_list_handed_back_goes_to_the_next_caller_of_exactly_its_run() -> None:
    pool = BlockIdPool(4 * CHUNK)
    first = pool.ids(((100, 20),))
    assert first == list(range(100, 120))
    assert pool.ids(((100, 20),)) is not first, "nothing is shared before it is handed back"
    pool.keep((100, 20), first)
    other = pool.ids(((100, 21),))
    assert other is not first and other == list(range(100, 121))
    assert pool.ids(((100, 20),)) is first
    assert pool.ids(((100, 20),)) is not first, "a list handed back goes to one caller"
    several = ((0, 3), (50, 2))
    assert pool.ids(several) == [0, 1, 2, 50, 51]


def test_lists_handed_back_are_bounded_oldest_dropped_first() -> None:
    pool = BlockIdPool(100)
    lists = {start: pool.ids(((start, 30),)) for start in (0, 30, 60)}
    for start, ids in lists.items():
        pool.keep((start, 30), ids)  # 90 ids kept
    pool.keep((70, 30), pool.ids(((70, 30),)))  # 120: the oldest, (0, 30), is dropped
    assert pool.ids(((30, 30),)) is lists[30]
    assert pool.ids(((60, 30),)) is lists[60]
    again = pool.ids(((0, 30),))
    assert again is not lists[0] and again == lists[0]
    many = BlockIdPool(10 * MAX_KEPT)
    handed = {start: many.ids(((start, 1),)) for start in range(2 * MAX_KEPT)}
    for start, ids in handed.items():
        many.keep((start, 1), ids)
    back = [start for start, ids in handed.items() if many.ids(((start, 1),)) is ids]
    assert back == list(range(MAX_KEPT, 2 * MAX_KEPT)), "the newest MAX_KEPT are kept"


def test_an_entry_saved_where_another_left_gets_its_list() -> None:
    alloc = BlockAllocator(40)
    first = alloc.alloc("a", 10)
    assert first is not None
    ids = alloc.block_ids(first)
    alloc.discard("a")
    second = alloc.alloc("b", 10)
    assert second is not None and second.runs == first.runs
    assert alloc.block_ids(second) is ids and ids == second.block_ids
