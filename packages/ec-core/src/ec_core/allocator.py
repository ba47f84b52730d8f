"""The block allocator: which mm_hash owns which blocks, and in what state.

It lives in the scheduler process only and is not thread-safe: vLLM's
scheduler calls the connector from one thread. Entry states:

    NOT_READY --mark_ready--> READY <--pin / last unpin--> PINNED (nested)
    NOT_READY --discard--> gone          READY --evict / drop--> gone

Only READY entries with no pin are evictable. Blocks are handed out as runs
of consecutive ids, one run per entry whenever the free space allows it, so a
copy of an entry is one descriptor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ec_core.extents import FreeExtents, Run
from ec_core.policy import EvictionPolicy, LRUPolicy


class AllocatorError(RuntimeError):
    """An operation that the entry's current state forbids (a caller bug)."""


@dataclass(eq=False, slots=True)
class Entry:
    """One cached encoder output: its blocks, shape and state.

    `runs` are `(first_block, num_blocks)` spans in address order whose
    lengths sum to `num_blocks`; `shape` is the `(rows, cols)` of the tensor
    the blocks hold. `pins` counts loads in flight; it is only ever positive
    on a ready entry.
    """

    key: str
    runs: tuple[Run, ...]
    num_blocks: int
    shape: tuple[int, int] | None = None
    ready: bool = False
    pins: int = 0

    @property
    def evictable(self) -> bool:
        return self.ready and self.pins == 0

    @property
    def block_ids(self) -> list[int]:
        """The block ids, in the order the entry's bytes are laid out."""
        if len(self.runs) == 1:
            start, length = self.runs[0]
            return list(range(start, start + length))
        ids: list[int] = []
        for start, length in self.runs:
            ids.extend(range(start, start + length))
        return ids


class BlockAllocator:
    """Allocates runs of blocks to keys and evicts by a pluggable policy.

    Guarantees, whatever the call sequence: no block is owned by two entries;
    free blocks plus owned blocks are exactly the pool; a not-ready or pinned
    entry is never evicted; `alloc` evicts nothing when it cannot succeed.
    """

    def __init__(
        self,
        num_blocks: int,
        policy: EvictionPolicy | None = None,
        *,
        on_evict: Callable[[Entry], None] | None = None,
    ) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self._on_evict = on_evict
        self._free = FreeExtents(num_blocks)
        self._entries: dict[str, Entry] = {}
        self._evictable_blocks = 0
        self._num_evictable = 0
        self.evictions = 0

    # ------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    @property
    def num_free_blocks(self) -> int:
        return self._free.total

    @property
    def num_evictable_blocks(self) -> int:
        return self._evictable_blocks

    @property
    def num_free_runs(self) -> int:
        return len(self._free)

    def largest_free_run(self) -> int:
        return self._free.largest()

    def has_held_entries(self) -> bool:
        """True while some entry is not ready or pinned. O(1)."""
        return self._num_evictable != len(self._entries)

    def can_fit(self, n: int) -> bool:
        """Whether `alloc(_, n)` could succeed now (free plus evictable)."""
        return 0 <= n <= self._free.total + self._evictable_blocks

    # --------------------------------------------------------- transitions

    def alloc(self, key: str, n: int, shape: tuple[int, int] | None = None) -> Entry | None:
        """Allocate `n` blocks for a new, not-ready entry, evicting as needed.

        Returns None, having evicted nothing, when `n` exceeds the free plus
        evictable blocks (an entry larger than the whole pool included).
        Zero-block entries are legal. A key already present is a caller bug.
        """
        if key in self._entries:
            raise AllocatorError(f"entry {key!r} already exists")
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if not self.can_fit(n):
            return None
        while self._free.total < n:
            self._evict_one()
        runs: tuple[Run, ...]
        if n == 0:
            runs = ()
        else:
            run = self._free.take_contiguous(n)
            runs = (run,) if run is not None else tuple(self._free.take_scattered(n))
        entry = Entry(key=key, runs=runs, num_blocks=n, shape=shape)
        self._entries[key] = entry
        return entry

    def mark_ready(self, key: str) -> Entry:
        """A not-ready entry's bytes are in place: make it loadable and evictable."""
        entry = self._require(key)
        if entry.ready:
            raise AllocatorError(f"entry {key!r} is already ready")
        entry.ready = True
        self._became_evictable(entry)
        return entry

    def pin(self, key: str) -> Entry:
        """Protect a ready entry from eviction for one more load (pins nest)."""
        entry = self._require(key)
        if not entry.ready:
            raise AllocatorError(f"entry {key!r} is not ready and cannot be pinned")
        if entry.pins == 0:
            self._stopped_being_evictable(entry)
            self.policy.on_held(key)
        entry.pins += 1
        return entry

    def unpin(self, key: str) -> Entry:
        """Release one pin; the entry becomes evictable when the last one goes."""
        entry = self._require(key)
        if entry.pins <= 0:
            raise AllocatorError(f"entry {key!r} is not pinned")
        entry.pins -= 1
        if entry.pins == 0:
            self._became_evictable(entry)
        return entry

    def discard(self, key: str) -> Entry:
        """Free a not-ready entry (its save failed or never reported)."""
        entry = self._require(key)
        if entry.ready:
            raise AllocatorError(f"entry {key!r} is ready; use drop() to remove it")
        self._remove(entry)
        return entry

    def drop(self, key: str) -> Entry:
        """Remove an evictable entry on purpose (stale content, invalidation)."""
        entry = self._require(key)
        if not entry.evictable:
            raise AllocatorError(f"entry {key!r} is not evictable (not ready or pinned)")
        self._stopped_being_evictable(entry)
        self._remove(entry)
        return entry

    def clear(self) -> None:
        """Forget every entry and free every block."""
        for key in list(self._entries):
            self.policy.on_removed(key)
        self._entries.clear()
        self._free = FreeExtents(self.num_blocks)
        self._evictable_blocks = 0
        self._num_evictable = 0

    # ------------------------------------------------------------- checks

    def check(self) -> None:
        """Raise AssertionError unless every invariant holds (test helper)."""
        self._free.check()
        owned: list[Run] = []
        evictable_blocks = 0
        num_evictable = 0
        for entry in self._entries.values():
            assert sum(length for _, length in entry.runs) == entry.num_blocks
            assert entry.pins >= 0 and (entry.ready or entry.pins == 0)
            owned.extend(entry.runs)
            if entry.evictable:
                evictable_blocks += entry.num_blocks
                num_evictable += 1
        spans = sorted(owned + self._free.runs())
        position = 0
        for start, length in spans:
            assert start == position, f"block {min(start, position)} is owned twice or lost"
            position = start + length
        assert position == self.num_blocks, "free + owned blocks do not cover the pool"
        assert evictable_blocks == self._evictable_blocks
        assert num_evictable == self._num_evictable

    # ----------------------------------------------------------- internals

    def _require(self, key: str) -> Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def _became_evictable(self, entry: Entry) -> None:
        self._evictable_blocks += entry.num_blocks
        self._num_evictable += 1
        self.policy.on_evictable(entry.key, entry.num_blocks)

    def _stopped_being_evictable(self, entry: Entry) -> None:
        self._evictable_blocks -= entry.num_blocks
        self._num_evictable -= 1

    def _remove(self, entry: Entry) -> None:
        del self._entries[entry.key]
        for start, length in entry.runs:
            self._free.release(start, length)
        self.policy.on_removed(entry.key)

    def _evict_one(self) -> None:
        key = self.policy.victim()
        entry = self._entries.get(key) if key is not None else None
        # A policy that names a non-evictable key is broken; refusing here
        # keeps pinned and not-ready entries safe whatever the policy does.
        if entry is None or not entry.evictable:
            raise AllocatorError(
                f"policy {self.policy.name!r} named {key!r} as victim, which is not evictable"
            )
        self._stopped_being_evictable(entry)
        self._remove(entry)
        self.evictions += 1
        if self._on_evict is not None:
            self._on_evict(entry)
