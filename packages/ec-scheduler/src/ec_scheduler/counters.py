"""Event counters of the scheduler half, cumulative since start-up."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class SchedulerCounters:
    """How often each scheduler decision happened (monotonic counts)."""

    lookups: int = 0
    """Items a consumer was asked to provide and vLLM then scheduled, each once
    (counted in `update_state_after_alloc`, however often `has_cache_item` was asked)."""
    hits: int = 0
    """Lookups loaded from the region (the item's load was dispatched)."""
    loads_dispatched: int = 0
    loads_completed: int = 0
    """Loads every live rank finished (reported, or moved past)."""
    loads_reclaimed: int = 0
    """Loads still unreported past the report bound (their pins stay until they settle)."""
    load_rows: int = 0
    """Embedding rows served from the region."""
    load_bytes: int = 0
    """Bytes of encoder output served from the region."""
    saves_dispatched: int = 0
    saves_completed: int = 0
    saves_failed: int = 0
    saves_reclaimed: int = 0
    """Saves still unreported past the report bound (their blocks stay until they settle)."""
    reports_lost: int = 0
    """Copies that settled without their own report: the ranks had moved past them."""
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
    """Reports for unknown, already settled or repeated copies."""
    saves_by_rank: dict[int, int] = field(default_factory=dict)
    """Saves each rank reported landed."""
    loads_by_rank: dict[int, int] = field(default_factory=dict)
    """Loads each rank reported landed."""
    save_fallbacks_by_rank: dict[int, int] = field(default_factory=dict)
    """Saves each rank copied synchronously because its batch failed."""
    load_fallbacks_by_rank: dict[int, int] = field(default_factory=dict)
    """Loads each rank copied synchronously because its batch or buffer failed."""

    @property
    def save_fallbacks(self) -> int:
        return sum(self.save_fallbacks_by_rank.values())

    @property
    def load_fallbacks(self) -> int:
        return sum(self.load_fallbacks_by_rank.values())

    def as_dict(self) -> dict[str, Any]:
        """Every field (per-rank ones as `{rank: count}`) plus the fallback totals."""
        data = asdict(self)
        data["save_fallbacks"] = self.save_fallbacks
        data["load_fallbacks"] = self.load_fallbacks
        return data
