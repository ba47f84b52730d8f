"""Block-id lists for the per-step metadata, built from shared int objects.

The seed's metadata carries each save and load as a plain `list[int]` of block
ids. Building one with `list(range(start, stop))` creates a new int object per
id above 256, which is most of what a save or a load costs the scheduler. The
pool keeps one int object per block id, made the first time a chunk of the
region is named, and hands out slices of those: a list of `n` ids then costs
`n` reference increments, whatever the region's size.

A slice still touches every int object it names (one reference increment
each, and one decrement when the list goes), and over a large region those
objects are mostly out of the CPU's caches: a list of 576 ids costs ~9 us
cold against ~1 us warm (random spans of a pool of 2**19 ids, against one
span again and again). Items of one size land again and again on the runs
their predecessors left (with a model whose images all have the same token
count the region becomes a grid of equal runs, and a save takes the run its
victim just left), so the allocator hands back the list of an entry of a
single run when the entry leaves (`keep`), and the next entry of exactly
that run gets that list object: nothing is touched, neither when the entry
leaves nor when the next one is saved.

Memory: 36 bytes per block id in the chunks named so far (one pointer, one
int), at most that per block of the region, plus the lists handed back, at
most `MAX_KEPT` of them and one pointer per block of the region in all.
vLLM's in-tree scheduler keeps a free list of every block id, which costs
about the same as the chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

CHUNK_BITS = 16
"""Ids are made in chunks of 2**CHUNK_BITS (2.3 MiB each), on first use."""
_CHUNK = 1 << CHUNK_BITS
MAX_KEPT = 32
"""Lists handed back (`keep`) that wait for an entry of their run: a save reuses
the one its victim left at once, so a few cover the grid case."""


class BlockIdPool:
    """Lists of block ids for runs of blocks in `[0, num_blocks)`.

    Every list returned equals the ids of the runs in order. `span` returns a
    new list; `ids` returns, for a single run, the list handed back for that
    run if there is one (see the module), so its callers, and whoever they
    pass the list to, must never change what they get. Time is proportional
    to the ids returned, or O(1) for a list handed back, plus, once per chunk
    of the region, the making of that chunk.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._chunks: list[list[int] | None] = [None] * -(-num_blocks // _CHUNK)
        self._kept: dict[tuple[int, int], list[int]] = {}
        """Lists handed back, by their run, oldest first: at most `MAX_KEPT`, their
        lengths summing to `_kept_ids`, at most `num_blocks`."""
        self._kept_ids = 0

    @property
    def num_chunks_made(self) -> int:
        """How many chunks hold int objects now (memory use, for tests)."""
        return sum(chunk is not None for chunk in self._chunks)

    def ids(self, runs: Sequence[tuple[int, int]]) -> list[int]:
        """The block ids of `runs` (`(first, length)` pairs), run after run (for a
        single run, the list handed back for it, if any: read only)."""
        if len(runs) == 1:
            run = runs[0]
            ids = self._kept.pop(run, None)
            if ids is None:
                return self.span(*run)
            self._kept_ids -= len(ids)
            return ids
        joined: list[int] = []
        for start, length in runs:
            joined += self.span(start, length)
        return joined

    def keep(self, run: tuple[int, int], ids: list[int]) -> None:
        """Hand back `ids`, the list `ids((run,))` gave an entry that has left, for
        the next entry of exactly `run` (the oldest lists are dropped past the
        bounds; see the module)."""
        kept = self._kept
        self._kept_ids += len(ids) - len(kept.pop(run, ()))
        kept[run] = ids
        while len(kept) > MAX_KEPT or self._kept_ids > self.num_blocks:
            self._kept_ids -= len(kept.pop(next(iter(kept))))

    def span(self, start: int, length: int) -> list[int]:
        """`[start, start + length)` as a new list. Raises IndexError outside the region."""
        stop = start + length
        if start < 0 or length < 0 or stop > self.num_blocks:
            raise IndexError(f"blocks [{start}, {stop}) outside [0, {self.num_blocks})")
        if length == 0:
            return []
        first, last = start >> CHUNK_BITS, (stop - 1) >> CHUNK_BITS
        if first == last:
            base = first << CHUNK_BITS
            return self._chunk(first)[start - base : stop - base]
        ids: list[int] = []
        for index in range(first, last + 1):
            base = index << CHUNK_BITS
            ids += self._chunk(index)[max(start - base, 0) : min(stop - base, _CHUNK)]
        return ids

    def _chunk(self, index: int) -> list[int]:
        chunk = self._chunks[index]
        if chunk is None:
            base = index << CHUNK_BITS
            chunk = list(range(base, min(base + _CHUNK, self.num_blocks)))
            self._chunks[index] = chunk
        return chunk
