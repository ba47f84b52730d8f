"""Event counters of the scheduler half, cumulative since start-up."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class SchedulerCounters:
    """How often each scheduler decision happened (monotonic counts)."""

    lookups: int = 0
    """`has_cache_item` calls on a consumer."""
    hits: int = 0
    """Lookups answered True (the item will be loaded)."""
    loads_dispatched: int = 0
    loads_completed: int = 0
    loads_failed: int = 0
    loads_reclaimed: int = 0
    """Loads whose reports never all arrived; their pins were released."""
    load_rows: int = 0
    """Embedding rows served from the region."""
    load_bytes: int = 0
    """Bytes of encoder output served from the region."""
    saves_dispatched: int = 0
    saves_completed: int = 0
    saves_failed: int = 0
    saves_reclaimed: int = 0
    """Saves whose report never arrived; their entries were discarded."""
    save_rows: int = 0
    """Embedding rows written to the region."""
    save_bytes: int = 0
    """Bytes of encoder output written to the region."""
    saves_skipped_full: int = 0
    """Region full of entries that cannot be evicted now (held)."""
    saves_not_admitted: int = 0
    """Saves the eviction policy's admission rule turned down."""
    saves_skipped_oversize: int = 0
    saves_skipped_empty: int = 0
    saves_skipped_unmeasured: int = 0
    stale_dropped: int = 0
    """Entries whose stored shape no longer matched the requesting item."""
    evictions: int = 0
    evicted_blocks: int = 0
    reports_ignored: int = 0
    """Reports for unknown, already released or repeated transfers."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
