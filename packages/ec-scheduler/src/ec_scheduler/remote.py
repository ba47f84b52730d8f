"""The scheduler's one seam for entries held by other engines.

Runs in the scheduler process. A transport package (ec-transfer-nixl)
announces a factory in the entry-point group `ec_cpu_tier.transports`; when a
cross-engine key is configured the scheduler builds one `RemoteSource` with
it, and hands it a `LocalEntries`: the only way the source's own threads touch
this engine's entries, always under the scheduler's lock. A fetched entry is
written into this engine's region like a save, so the workers load it like
any other entry.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ec_core.scheduler_process.allocator import BlockAllocator, Entry
from ec_core.scheduler_process.extents import Run

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from ec_core.layout import RegionLayout

TRANSPORT_GROUP = "ec_cpu_tier.transports"


ANY_WIDTH = 0
"""`Wanted.cols` of an item whose encoder output width this engine does not know."""


@dataclass(frozen=True, slots=True)
class Wanted:
    """An item a request needs that this engine does not hold: its key and `(rows, cols)`.

    `key` is the item's tier key (`ec_scheduler.tenancy`): the identifier, or for a
    request with a `cache_salt` the identifier wrapped with the salt's keyed digest,
    so peers that share the secret look up, lease and hand over only that salt's entry.

    `rows` is always the item's own embedding count. `cols` is ANY_WIDTH where
    vLLM measured no encoder output width for the item's modality here (a pure
    EC consumer: vLLM measures widths on producers only): a peer then answers
    with the width it holds, which `accepts` checks and `with_cols` fixes
    before anything is reserved or read.
    """

    key: str
    rows: int
    cols: int

    def accepts(self, shape: tuple[int, int], embed_width: int) -> bool:
        """Whether an entry of `shape` is this item in this engine's model.

        The rows must be the item's; the width the one asked for, or, for
        ANY_WIDTH, a whole positive multiple of the LM embedding width: an
        encoder output is the embedding itself, or (DeepStack) the embedding
        and further layers of the same width side by side. That a peer's
        width is the one this engine's model produces follows from the
        compatibility fingerprint (same model and config) it was asked under.
        """
        rows, cols = shape
        if rows != self.rows:
            return False
        if self.cols != ANY_WIDTH:
            return cols == self.cols
        return cols > 0 and embed_width > 0 and cols % embed_width == 0

    def with_cols(self, cols: int) -> Wanted:
        """This item with its width known."""
        return Wanted(self.key, self.rows, cols)


class RemoteSource(Protocol):
    """What a transport provides to the scheduler."""

    def wants(self, request: Request, missing: Sequence[Wanted]) -> bool:
        """The request's items not ready here (called from `ensure_cache_available`
        every time, `missing` possibly empty; an item may be absent, or on its way
        by a local save or a fetch).

        True while the request should wait for fetches started now or earlier;
        False once none is in flight for it (fetched items are then ready here,
        the rest are encoded). Must be cheap and must not block. Work it starts
        may wait for the next `step_done`.
        """

    def step_done(self) -> None:
        """The scheduler thread made this step's decisions (called without the lock,
        after a step that deferred a request): start what this step's `wants` asked
        for, together. Must not block."""

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """`ec_transfer_params` for a finished request: handles to this engine's entries
        of its items, named by their keys here (`LocalEntries.item_keys`)."""

    def stat_totals(self) -> dict[str, float]:
        """Cumulative counters of the transport (names in ec_core.stats)."""

    def shutdown(self) -> None:
        """Stop serving and fetching; release every lease and reservation. Idempotent."""


RemoteSourceFactory = Callable[["VllmConfig", "RegionLayout", "LocalEntries"], RemoteSource]


def load_remote_source(
    vllm_config: VllmConfig, layout: RegionLayout, local: LocalEntries
) -> RemoteSource:
    """Build the installed transport's source, or raise naming the package to install."""
    entries = list(importlib.metadata.entry_points(group=TRANSPORT_GROUP))
    if not entries:
        raise ValueError(
            "EC CPU tier: ec_peer_listen / ec_peers / a peer secret are set, but no "
            "cross-engine transport is installed; install ec-transfer-nixl "
            "(pip install ec-transfer-nixl, plus NIXL as its README says)"
        )
    factory: RemoteSourceFactory = entries[0].load()
    return factory(vllm_config, layout, local)


def _identifiers(request: Request) -> list[str]:
    return [feature.identifier for feature in request.mm_features]


EntryState = Literal["ready", "saving", "missing"]
Leased = tuple[EntryState | Literal["shape"], tuple[Run, ...], tuple[int, int] | None]
"""What `LocalEntries.lease` answers for one item: its state, the runs pinned for
the peer (when "ready") and the shape the entry is held in (when it is ready)."""


class LocalEntries:
    """This engine's entries as a remote source may see and change them.

    Every method takes the scheduler's lock, so a source's threads and vLLM's
    scheduler thread never change the allocator at the same time. Leases
    (producer side) are pins; reservations (consumer side) are not-ready
    entries that only `landed` makes loadable. `landed` and `abandon` act on
    the entry `reserve` made and on nothing else: once a reservation is over,
    its key may be this engine's own save (not ready either) in flight, whose
    blocks a worker is writing.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        lock: threading.RLock,
        release_pin: Callable[[str], None],
        is_stale: Callable[[str], bool],
        blocks_for: Callable[[int, int], int],
        *,
        refresh: Callable[[], None] = lambda: None,
        item_keys: Callable[[Request], list[str]] | None = None,
    ) -> None:
        """`refresh` runs (under the lock) before an entry's state is read, so
        reports that arrived off the engine loop count at once. `item_keys` gives
        the keys of a request's items here (`ec_scheduler.tenancy.TierKeys.keys_of`;
        None: their identifiers)."""
        self.item_keys: Callable[[Request], list[str]] = (
            item_keys if item_keys is not None else _identifiers
        )
        """The keys this engine holds a request's items under, in the items' order:
        what a handle names (a salted item's key carries only the salt's digest)."""
        self._allocator = allocator
        self._refresh = refresh
        self._lock = lock
        self._release_pin = release_pin
        self._is_stale = is_stale
        self._blocks_for = blocks_for
        self._reserved: dict[str, Entry] = {}
        """The reservations not yet landed or abandoned: the entry made for each key."""
        self.closed = False

    # ------------------------------------------------------ producer side

    def state(self, key: str) -> EntryState:
        return self.state_many((key,))[0]

    def state_many(self, keys: Iterable[str]) -> list[EntryState]:
        """`state` for each key, under one acquisition of the lock."""
        with self._lock:
            self._refresh()
            get, stale = self._allocator.get, self._is_stale
            out: list[EntryState] = []
            for key in keys:
                entry = get(key)
                if entry is None or stale(key):
                    out.append("missing")
                else:
                    out.append("ready" if entry.ready else "saving")
            return out

    def shape(self, key: str) -> tuple[int, int] | None:
        with self._lock:
            entry = self._allocator.get(key)
            return entry.shape if entry is not None else None

    def lease(self, key: str, rows: int, cols: int) -> Leased:
        """Pin a ready entry of `(rows, cols)` for a peer (`cols` ANY_WIDTH: of `rows`
        rows and whatever width); its state, runs and shape (runs only when "ready",
        the shape whenever the entry is ready)."""
        return self.lease_many(((key, rows, cols),))[0]

    def lease_many(
        self, items: Sequence[tuple[str, int, int]], *, reads: bool = True
    ) -> list[Leased]:
        """`lease` for each `(key, rows, cols)`, under one acquisition of the lock (a key
        asked twice is pinned twice). `reads`: a peer asked to read them (its lookup),
        so each one leased is a request to the policy; False for a handle granted
        before anyone asks, whose reads are told when a peer claims it (`note_reads`)."""
        with self._lock:
            if self.closed:
                return [("missing", (), None)] * len(items)
            self._refresh()
            allocator = self._allocator
            get, stale, pin = allocator.get, self._is_stale, allocator.pin_entry
            out: list[Leased] = []
            for key, rows, cols in items:
                entry = get(key)
                if entry is None or stale(key):
                    out.append(("missing", (), None))
                elif not entry.ready or entry.shape is None:
                    out.append(("saving", (), None))
                elif entry.shape[0] != rows or (cols != ANY_WIDTH and entry.shape[1] != cols):
                    out.append(("shape", (), entry.shape))
                else:
                    pin(entry)
                    if reads:
                        allocator.note_request(key)  # a read served from here
                    out.append(("ready", entry.runs, entry.shape))
            return out

    def note_reads(self, keys: Iterable[str]) -> None:
        """A peer reads `keys` under a handle it claimed: each one held is a request to
        the policy, as a lookup's lease is (`lease_many`)."""
        with self._lock:
            if self.closed:
                return
            allocator = self._allocator
            for key in keys:
                if key in allocator:
                    allocator.note_request(key)

    def release(self, keys: Iterable[str]) -> None:
        """Give back leases taken with `lease` (one pin each)."""
        with self._lock:
            if self.closed:
                return
            for key in keys:
                if key in self._allocator:
                    self._release_pin(key)

    # ------------------------------------------------------ consumer side

    def reserve(self, key: str, rows: int, cols: int) -> tuple[Run, ...] | None:
        """Blocks for an entry about to be fetched, or None (held already, or no room).

        The entry is not ready: nothing loads it and no save is allocated for
        its key until `landed` or `abandon`.
        """
        return self.reserve_many(((key, rows, cols),))[0]

    def reserve_many(self, wanted: Sequence[tuple[str, int, int]]) -> list[tuple[Run, ...] | None]:
        """`reserve` for each `(key, rows, cols)`, under one acquisition of the lock."""
        with self._lock:
            if self.closed:
                return [None] * len(wanted)
            alloc, blocks_for = self._allocator.alloc, self._blocks_for
            out: list[tuple[Run, ...] | None] = []
            for key, rows, cols in wanted:
                if key in self._allocator:
                    out.append(None)
                    continue
                entry = alloc(key, blocks_for(rows, cols), (rows, cols), force=True)
                if entry is None:
                    out.append(None)
                else:
                    self._reserved[key] = entry
                    out.append(entry.runs)
            return out

    def landed_many(self, keys: Sequence[str]) -> list[bool]:
        """`landed` for each key, under one acquisition of the lock."""
        with self._lock:
            out: list[bool] = []
            for key in keys:
                entry = self._reservation(key)
                if self.closed or entry is None:
                    out.append(False)
                else:
                    self._allocator.mark_ready(key)
                    out.append(True)
            return out

    def landed(self, key: str) -> bool:
        """The fetched bytes are in place: make the entry ready (False if it went away)."""
        return self.landed_many((key,))[0]

    def abandon(self, key: str) -> None:
        """Free a reservation whose fetch failed (only once nothing can write to it)."""
        self.abandon_many((key,))

    def abandon_many(self, keys: Iterable[str]) -> None:
        """`abandon` for each key, under one acquisition of the lock."""
        with self._lock:
            if self.closed:
                return
            for key in keys:
                if self._reservation(key) is not None:
                    self._allocator.discard(key)

    def _reservation(self, key: str) -> Entry | None:
        """End the reservation of `key` and return its entry; None when there is none
        to end (it landed, was abandoned, or was never made here), whatever entry
        `key` names now."""
        entry = self._reserved.pop(key, None)
        if entry is None or entry.ready or self._allocator.get(key) is not entry:
            return None
        return entry
