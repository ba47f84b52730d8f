"""Free space of a block pool, kept as maximal runs of consecutive blocks.

No operation depends on the number of blocks: a run of a million blocks costs
the same as a run of one. Lookups by address are dictionary lookups; the
best-fit search is a binary search, O(log e) in the number `e` of free runs,
over a plain sorted list, so inserting or removing a run also moves up to `e`
pointers (one C `memmove`). For the few thousand runs a region has at most
(runs never touch, and every run lies between two entries) that is cheaper
than any tree built in Python, which is what this module is timed against.
"""

from __future__ import annotations

from bisect import bisect_left, insort

Run = tuple[int, int]
"""`(first_block, num_blocks)`: a contiguous span, `num_blocks >= 1`."""


class FreeExtents:
    """The free blocks of a pool `[0, num_blocks)` as disjoint, maximal runs.

    Invariants (checked by `check()` in tests): runs never overlap or touch
    (adjacent runs are always merged), `total` is the sum of their lengths,
    and the three indexes describe the same set of runs.
    """

    __slots__ = ("_by_size", "lengths_by_start", "starts_by_end", "total")

    def __init__(self, num_blocks: int) -> None:
        self.lengths_by_start: dict[int, int] = {}
        """Each free run's length by its first block (read-only outside this class)."""
        self.starts_by_end: dict[int, int] = {}
        """Each free run's first block by its one-past-last block (read-only outside)."""
        self._by_size: list[Run] = []
        """`(length, start)` of every run, sorted: best fit is the first at or after `(n, -1)`."""
        self.total = 0
        if num_blocks > 0:
            self._insert(0, num_blocks)

    def __len__(self) -> int:
        """The number of free runs."""
        return len(self.lengths_by_start)

    def run_ending_at(self, end: int) -> int | None:
        """The start of the free run that ends at `end`, if there is one."""
        return self.starts_by_end.get(end)

    def run_length_at(self, start: int) -> int | None:
        """The length of the free run that starts at `start`, if there is one."""
        return self.lengths_by_start.get(start)

    def runs(self) -> list[Run]:
        """All free runs in address order (for tests and diagnostics)."""
        return sorted(self.lengths_by_start.items())

    def release(self, start: int, length: int) -> None:
        """Return `[start, start + length)` to the pool, merging neighbours."""
        if length <= 0:
            return
        end = start + length
        before = self.starts_by_end.get(start)
        if before is not None:
            length += start - before
            self._remove(before)
            start = before
        after_len = self.lengths_by_start.get(end)
        if after_len is not None:
            self._remove(end)
            length += after_len
        self._insert(start, length)

    def take_contiguous(self, n: int) -> Run | None:
        """Carve `n` blocks from the smallest free run that holds them.

        Best fit keeps long runs intact for long entries. Returns None when no
        single run is long enough (the caller may then use `take_scattered`).
        """
        if n <= 0 or not self._by_size:
            return None
        by_size = self._by_size
        index = bisect_left(by_size, (n, -1))
        if index == len(by_size):
            return None
        length, start = self._remove_at(index)
        if length > n:
            self._insert(start + n, length - n)
        return (start, n)

    def take_from(self, start: int, n: int) -> Run:
        """Carve `n` blocks from the front of the free run that starts at `start`.

        The caller knows the run exists and holds `n` blocks (KeyError or
        ValueError otherwise, with nothing changed).
        """
        length = self.lengths_by_start[start]
        if not 0 < n <= length:
            raise ValueError(f"the free run at {start} holds {length} blocks, not {n}")
        self._remove(start)
        if length > n:
            self._insert(start + n, length - n)
        return (start, n)

    def take_scattered(self, n: int) -> list[Run]:
        """Carve `n` blocks from the longest runs, fewest pieces first.

        The caller guarantees `n <= total`. Runs come back in address order.
        """
        if n > self.total:
            raise ValueError(f"asked for {n} blocks but only {self.total} are free")
        taken: list[Run] = []
        while n > 0:
            length, start = self._remove_at(len(self._by_size) - 1)
            use = min(length, n)
            if length > use:
                self._insert(start + use, length - use)
            taken.append((start, use))
            n -= use
        taken.sort()
        return taken

    def check(self) -> None:
        """Raise AssertionError if the indexes disagree (test helper)."""
        runs = sorted(self.lengths_by_start.items())
        assert len(runs) == len(self.starts_by_end) == len(self._by_size)
        assert self.total == sum(length for _, length in runs)
        previous_end = -1
        for start, length in runs:
            assert length > 0
            assert start > previous_end, "free runs overlap or touch"
            assert self.starts_by_end[start + length] == start
            assert (length, start) in self._by_size
            previous_end = start + length

    def _insert(self, start: int, length: int) -> None:
        self.lengths_by_start[start] = length
        self.starts_by_end[start + length] = start
        insort(self._by_size, (length, start))
        self.total += length

    def _remove(self, start: int) -> None:
        length = self.lengths_by_start[start]
        index = bisect_left(self._by_size, (length, start))
        assert self._by_size[index] == (length, start), "size index out of date"
        self._remove_at(index)

    def _remove_at(self, index: int) -> tuple[int, int]:
        """Take the free run at `index` of the size index out of all three indexes;
        its `(length, start)`."""
        length, start = self._by_size.pop(index)
        del self.lengths_by_start[start]
        del self.starts_by_end[start + length]
        self.total -= length
        return length, start
