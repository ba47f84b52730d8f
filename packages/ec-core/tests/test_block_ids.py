"""The block-id pool: the lists the metadata carries, made from shared int objects."""

from __future__ import annotations

import random

import pytest

from ec_core.scheduler_process.allocator import BlockAllocator, Entry
from ec_core.scheduler_process.block_ids import CHUNK_BITS, BlockIdPool

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
