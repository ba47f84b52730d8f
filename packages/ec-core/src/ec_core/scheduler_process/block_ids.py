"""Block-id lists for the per-step metadata, built from shared int objects.

The seed's metadata carries each save and load as a plain `list[int]` of block
ids. Building one with `list(range(start, stop))` creates a new int object per
id above 256, which is most of what a save or a load costs the scheduler. The
pool keeps one int object per block id, made the first time a chunk of the
region is named, and hands out slices of those: a list of `n` ids then costs
`n` reference increments, whatever the region's size.

Memory: 36 bytes per block id in the chunks named so far (one pointer, one
int), at most that per block of the region. vLLM's in-tree scheduler keeps a
free list of every block id, which costs the same.
"""

from __future__ import annotations

from collections.abc import Sequence

CHUNK_BITS = 16
"""Ids are made in chunks of 2**CHUNK_BITS (2.3 MiB each), on first use."""
_CHUNK = 1 << CHUNK_BITS


class BlockIdPool:
    """Lists of block ids for runs of blocks in `[0, num_blocks)`.

    Every list returned is new (the caller may keep or change it) and equal to
    the ids of the runs in order. Time is proportional to the ids returned,
    plus, once per chunk of the region, the making of that chunk.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._chunks: list[list[int] | None] = [None] * -(-num_blocks // _CHUNK)

    @property
    def num_chunks_made(self) -> int:
        """How many chunks hold int objects now (memory use, for tests)."""
        return sum(chunk is not None for chunk in self._chunks)

    def ids(self, runs: Sequence[tuple[int, int]]) -> list[int]:
        """The block ids of `runs` (`(first, length)` pairs), run after run."""
        if len(runs) == 1:
            start, length = runs[0]
            return self.span(start, length)
        ids: list[int] = []
        for start, length in runs:
            ids += self.span(start, length)
        return ids

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
