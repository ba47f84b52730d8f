"""The block allocator: which mm_hash owns which blocks, and in what state.

It lives in the scheduler process only and is not thread-safe: vLLM's
scheduler calls the connector from one thread. Entry states:

    NOT_READY --mark_ready--> READY <--pin / last unpin--> PINNED (nested)
    NOT_READY --discard--> gone          READY --evict / drop--> gone

Only READY entries with no pin are evictable. Blocks are handed out as runs
of consecutive ids, one run per entry whenever the policy allows, so a copy of
an entry is one descriptor: when no free run is long enough, the allocator
evicts a cheap *window* of address-adjacent evictable entries — weighed by
their rank in the policy's victim order — rather than the policy's first
victims wherever they lie. While the policy says its order must be kept
exactly (`EvictionPolicy.strict_order`: plain LRU, W-TinyLFU in recency
mode), a window may hold only the victims the policy names for this
allocation, and nobody is evicted while the free blocks suffice; otherwise
those victims go and the new entry takes the freed space in as few runs as it
can (one descriptor per run).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from ec_core.scheduler_process.block_ids import BlockIdPool
from ec_core.scheduler_process.extents import FreeExtents, Run
from ec_core.scheduler_process.policy import EvictionPolicy
from ec_core.scheduler_process.policy_lru import LRUPolicy

WINDOW_CANDIDATES = 32
"""How many of the policy's preferred victims are ranked for a window search."""
_UNRANKED = 2 * WINDOW_CANDIDATES
"""The rank charged for a neighbour outside the policy's first candidates (while
the order is not strict: a strict order lets no such neighbour into a window)."""
WINDOW_STEPS = 4096
"""Growth steps (a neighbour or a free run joining a window) one window search takes
at most once it has something to fall back on (a window found, or the policy's own
victims while its order is strict). Windows of similar entries take a few steps
each; an entry thousands of times larger than its neighbours would otherwise cost
one full-grown window per seed instead of one."""


def _run_length(run: Run) -> int:
    return run[1]


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
    ids: list[int] | None = field(default=None, repr=False)
    """The block-id list the metadata carries, made on first use (`BlockAllocator.block_ids`)."""

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
    free blocks plus owned blocks are exactly the reserved prefix of the pool
    (`[0, num_reserved_blocks)`; see `extend_reserved`); a not-ready or pinned
    entry is never evicted; `alloc` evicts nothing when it cannot succeed.
    """

    def __init__(
        self,
        num_blocks: int,
        policy: EvictionPolicy | None = None,
        *,
        on_evict: Callable[[Entry], None] | None = None,
        reserved: int | None = None,
    ) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if reserved is not None and not 0 <= reserved <= num_blocks:
            raise ValueError(f"reserved must be in [0, {num_blocks}], got {reserved}")
        self.num_blocks = num_blocks
        self.num_reserved_blocks = num_blocks if reserved is None else reserved
        """Blocks `[0, num_reserved_blocks)` make up the pool; the rest are never
        handed out (not yet backed by reserved pages). Only `extend_reserved`
        raises it, and it never decreases."""
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self._on_evict = on_evict
        self._free = FreeExtents(self.num_reserved_blocks)
        self._ids = BlockIdPool(num_blocks)
        self._entries: dict[str, Entry] = {}
        """Never rebound (cleared in place), so `get` below stays its lookup."""
        self.get: Callable[[str], Entry | None] = self._entries.get
        """The entry of a key, or None: the dict's own `get`, bound once (the
        scheduler looks entries up several times per item, and a method of this
        class would add a Python frame to each)."""
        # Owner of each allocated run, by its first and by its one-past-last block.
        self._run_at: dict[int, Entry] = {}
        self._run_ending: dict[int, Entry] = {}
        self._evictable_blocks = 0
        self._num_evictable = 0
        self.evictions = 0
        self.last_refusal: Literal["full", "admission"] | None = None
        """Why the last `alloc` returned None."""

    # ------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def block_ids(self, entry: Entry) -> list[int]:
        """`entry.block_ids`, made once per entry from shared int objects (`BlockIdPool`).

        Every save and load of the entry gets this same list, and so may a later
        entry of the same single run: the metadata only reads it, and a reader
        must never change it. An entry's runs never change, so the list stays
        right for the entry's life.
        """
        ids = entry.ids
        if ids is None:
            ids = entry.ids = self._ids.ids(entry.runs)
        return ids

    @property
    def num_free_blocks(self) -> int:
        return self._free.total

    @property
    def num_evictable_blocks(self) -> int:
        return self._evictable_blocks

    @property
    def num_free_runs(self) -> int:
        return len(self._free)

    @property
    def num_held_entries(self) -> int:
        """Entries not ready or pinned (not evictable)."""
        return len(self._entries) - self._num_evictable

    def has_held_entries(self) -> bool:
        """True while some entry is not ready or pinned. O(1)."""
        return self._num_evictable != len(self._entries)

    def can_fit(self, n: int) -> bool:
        """Whether `alloc(_, n)` could succeed now (free plus evictable)."""
        return 0 <= n <= self._free.total + self._evictable_blocks

    # --------------------------------------------------------- transitions

    def note_request(self, key: str) -> None:
        """Tell the policy someone asked for `key` (feeds its popularity history), and
        whether a ready entry of it is here (a hit)."""
        entry = self._entries.get(key)
        self.policy.on_request(key, entry is not None and entry.ready)

    def alloc(
        self, key: str, n: int, shape: tuple[int, int] | None = None, *, force: bool = False
    ) -> Entry | None:
        """Allocate `n` blocks for a new, not-ready entry, evicting as needed.

        Returns None, having evicted nothing, when `n` exceeds the free plus
        evictable blocks (an entry larger than the whole pool included;
        `last_refusal == "full"`) or when the policy does not admit the item
        (`"admission"`; `force` skips the policy's admission rule, for an item
        being fetched for a request right now). Zero-block entries are legal.
        A key already present is a caller bug.
        """
        if key in self._entries:
            raise AllocatorError(f"entry {key!r} already exists")
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        self.last_refusal = None
        free = self._free
        if n > free.total + self._evictable_blocks:  # `can_fit`, inline: the hot path
            self.last_refusal = "full"
            return None
        if not force and not self.policy.admit(key, n):
            self.last_refusal = "admission"
            return None
        runs: tuple[Run, ...] = ()
        if n > 0:
            run = free.take_contiguous(n)
            if run is None:
                run = self._make_room_contiguous(n)
            if run is None:  # no window: the policy's own victims, in its order
                # Only as many as the free blocks lack: evicting the first victim
                # even when the free pieces add up to `n` cost fewer runs but
                # less hit ratio (Table 1, issue 36: sum of the 30 rows' byte hit
                # ratios with `lru` 14.808 -> 14.839, mean runs 3.42 -> 4.22).
                while free.total < n:
                    self._evict_one()
                run = free.take_contiguous(n)
            runs = (run,) if run is not None else tuple(free.take_scattered(n))
        entry = Entry(key, runs, n, shape)
        self._entries[key] = entry
        for start, length in runs:
            self._run_at[start] = entry
            self._run_ending[start + length] = entry
        self.policy.on_insert(key, n)
        return entry

    def _make_room_contiguous(self, n: int) -> Run | None:
        """Evict the cheapest window of adjacent evictable entries holding `n` blocks.

        The policy's first WINDOW_CANDIDATES victims are ranked (0 = evict
        first). Each of them seeds a window around its run, grown over free
        runs (free of cost) and then over the cheaper evictable neighbour until
        it spans `n` blocks; a member costs its blocks times (1 + rank), a
        neighbour the policy did not rank costs as if ranked twice the list's
        length. The cheapest window wins. None when no window can be formed
        (pinned or not-ready neighbours everywhere).

        While the policy's order is strict, only the victims `alloc` would
        evict without a window (`_policy_victims`: none while the free blocks
        suffice; the first WINDOW_CANDIDATES of them) may be in a window: it
        may keep some of them, never cost anyone else. None when no window of
        them spans `n` blocks.
        O(WINDOW_CANDIDATES) seeds, each pruned as soon as it costs more than
        the best so far; once there is a fallback, all of them together grow at
        most WINDOW_STEPS steps.
        """
        strict = self.policy.strict_order
        if strict and self._free.total >= n:
            return None  # the free pieces hold it: evicting anyone would break the order
        first = self._entries.get(next(self.policy.candidates(), ""))
        if first is not None and first.ready and first.pins == 0 and first.runs:
            # The policy's own first victim may open a long enough run: then it
            # is the cheapest window there is (the usual case when sizes are
            # similar).
            runs = first.runs
            start, length = runs[0] if len(runs) == 1 else max(runs, key=_run_length)
            free = self._free
            before = free.run_ending_at(start)
            after = free.run_length_at(start + length)
            opened = start if before is None else before
            if start + length + (after or 0) - opened >= n:
                self._evict(first)
                if len(runs) == 1:
                    # No free run held `n` blocks before, so the one the victim
                    # opened is the only one that does: best fit is to carve it.
                    return free.take_from(opened, n)
                return free.take_contiguous(n)
        if strict:
            # None then lets `alloc` evict exactly the policy's first victims.
            ranks = {key: rank for rank, key in enumerate(self._policy_victims(n))}
            unranked = math.inf
        else:
            ranks = {
                key: rank
                for rank, key in enumerate(
                    itertools.islice(self.policy.candidates(), WINDOW_CANDIDATES)
                )
            }
            unranked = float(_UNRANKED)
        best: list[Entry] | None = None
        best_cost = math.inf
        steps_left = WINDOW_STEPS
        for key, rank in ranks.items():
            seed = self._entries.get(key)
            if seed is None or not seed.evictable or not seed.runs:
                continue
            if seed.num_blocks * (1 + rank) >= best_cost:
                continue  # its window costs at least the seed itself: no better
            bounded = best is not None or strict
            if bounded and steps_left <= 0:
                break
            found, steps = self._grow_window(
                seed,
                n,
                ranks,
                unranked=unranked,
                budget=best_cost,
                max_steps=steps_left if bounded else math.inf,
            )
            steps_left -= steps
            if found is not None:
                best, best_cost = found
        if best is None:
            return None
        for entry in best:
            self._evict(entry)
        return self._free.take_contiguous(n)

    def _policy_victims(self, n: int) -> list[str]:
        """The policy's first victims (at least one), in its order, whose eviction
        frees enough blocks for `n` (what `alloc` evicts when no window is taken);
        at most the first WINDOW_CANDIDATES of them."""
        needed = n - self._free.total
        victims = []
        entries = self._entries
        for key in itertools.islice(self.policy.candidates(), WINDOW_CANDIDATES):
            entry = entries.get(key)
            if entry is None or not entry.evictable:
                break  # a broken policy: `_evict_one` refuses it with a clear error
            victims.append(key)
            needed -= entry.num_blocks
            if needed <= 0:
                break
        return victims

    def _grow_window(
        self,
        seed: Entry,
        n: int,
        ranks: dict[str, int],
        *,
        unranked: float,
        budget: float,
        max_steps: float,
    ) -> tuple[tuple[list[Entry], float] | None, int]:
        """The victims and cost of the window grown from `seed` (None when it cannot
        reach `n` blocks, costs `budget` or more, or needs more than `max_steps`
        growth steps), and the steps it took.

        Free runs join for nothing; otherwise the cheaper evictable neighbour
        joins (the left one on a tie). This is the allocator's inner loop, so
        lookups are bound to locals and costs are compared inline.
        """
        rank_of = ranks.get
        free_ending_at = self._free.starts_by_end.get  # `run_ending_at`, without its frame
        free_length_at = self._free.lengths_by_start.get  # `run_length_at`, likewise
        owner_ending_at = self._run_ending.get
        owner_at = self._run_at.get
        start, length = seed.runs[0] if len(seed.runs) == 1 else max(seed.runs, key=_run_length)
        left, right = start, start + length
        victims = [seed]
        chosen = {seed}  # `victims` as a set: a membership test is O(1), not O(window)
        cost = float(seed.num_blocks * (1 + rank_of(seed.key, unranked)))
        steps = 0
        while right - left < n:
            if cost >= budget or steps >= max_steps:
                return None, steps
            steps += 1
            free_before = free_ending_at(left)
            if free_before is not None:
                left = free_before
                continue
            free_after = free_length_at(right)
            if free_after is not None:
                right += free_after
                continue
            before, after = owner_ending_at(left), owner_at(right)
            before_cost = after_cost = math.inf
            if before is not None and before.ready and before.pins == 0 and before not in chosen:
                before_cost = before.num_blocks * (1 + rank_of(before.key, unranked))
            if after is not None and after.ready and after.pins == 0 and after not in chosen:
                after_cost = after.num_blocks * (1 + rank_of(after.key, unranked))
            if before_cost <= after_cost:
                if before is None or before_cost == math.inf:
                    return None, steps
                cost += before_cost
                victims.append(before)
                chosen.add(before)
                runs = before.runs
                left = runs[0][0] if len(runs) == 1 else self._run_of(before, left, "l")[0]
            else:
                assert after is not None
                cost += after_cost
                victims.append(after)
                chosen.add(after)
                runs = after.runs
                run_start, run_length = (
                    runs[0] if len(runs) == 1 else self._run_of(after, right, "r")
                )
                right = run_start + run_length
        return ((victims, cost) if cost < budget else None), steps

    @staticmethod
    def _run_of(entry: Entry, boundary: int, side: str) -> Run:
        if len(entry.runs) == 1:
            return entry.runs[0]  # the only run of a neighbour is the one touching it
        for start, length in entry.runs:
            if (side == "l" and start + length == boundary) or (side == "r" and start == boundary):
                return (start, length)
        raise AssertionError("run index out of date")

    def mark_ready(self, key: str) -> Entry:
        """A not-ready entry's bytes are in place: make it loadable and evictable."""
        return self.mark_entry_ready(self._require(key))

    def mark_entry_ready(self, entry: Entry) -> Entry:
        """`mark_ready`, given the entry itself (it must be this allocator's)."""
        if entry.ready:
            raise AllocatorError(f"entry {entry.key!r} is already ready")
        entry.ready = True
        self._became_evictable(entry)
        return entry

    def pin(self, key: str) -> Entry:
        """Protect a ready entry from eviction for one more load (pins nest)."""
        return self.pin_entry(self._require(key))

    def pin_entry(self, entry: Entry) -> Entry:
        """`pin`, given the entry itself (it must be this allocator's)."""
        if not entry.ready:
            raise AllocatorError(f"entry {entry.key!r} is not ready and cannot be pinned")
        if entry.pins == 0:
            self._evictable_blocks -= entry.num_blocks
            self._num_evictable -= 1
            self.policy.on_held(entry.key)
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

    def extend_reserved(self, reserved: int) -> int:
        """Grow the pool to blocks `[0, reserved)` (clamped to `num_blocks`).

        The new blocks become free (merged with a free run ending at the old
        watermark). A watermark at or below the current one changes nothing.
        Returns how many blocks were added. O(log free runs).
        """
        reserved = min(reserved, self.num_blocks)
        added = reserved - self.num_reserved_blocks
        if added <= 0:
            return 0
        self._free.release(self.num_reserved_blocks, added)
        self.num_reserved_blocks = reserved
        return added

    def clear(self) -> None:
        """Forget every entry and free every reserved block."""
        for key in list(self._entries):
            self.policy.on_removed(key)
        self._entries.clear()
        self._run_at.clear()
        self._run_ending.clear()
        self._free = FreeExtents(self.num_reserved_blocks)
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
        assert position == self.num_reserved_blocks, "free + owned blocks do not cover the pool"
        assert len(self._run_at) == len(self._run_ending) == len(owned)
        for entry in self._entries.values():
            for start, length in entry.runs:
                assert self._run_at[start] is entry and self._run_ending[start + length] is entry
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
        runs = entry.runs
        for start, length in runs:
            del self._run_at[start]
            del self._run_ending[start + length]
            self._free.release(start, length)
        if entry.ids is not None and len(runs) == 1:
            self._ids.keep(runs[0], entry.ids)  # for the next entry of this run
        self.policy.on_removed(entry.key)

    def _evict_one(self) -> None:
        key = next(self.policy.candidates(), None)
        entry = self._entries.get(key) if key is not None else None
        # A policy that names a non-evictable key is broken; refusing here
        # keeps pinned and not-ready entries safe whatever the policy does.
        if entry is None or not entry.evictable:
            raise AllocatorError(
                f"policy {self.policy.name!r} named {key!r} as victim, which is not evictable"
            )
        self._evict(entry)

    def _evict(self, entry: Entry) -> None:
        if not entry.evictable:
            raise AllocatorError(f"entry {entry.key!r} is not evictable")
        self._stopped_being_evictable(entry)
        self._remove(entry)
        self.evictions += 1
        if self._on_evict is not None:
            self._on_evict(entry)
