"""The stats the scheduler half hands vLLM: counter deltas since the last hand-over, and gauges.

Runs in the scheduler process; vLLM ships the result to its front end, where
`ECCPUConnectorStats` and `ECCPUPromMetrics` (ec-core) turn it into the log
line and the Prometheus families.
"""

from __future__ import annotations

from collections.abc import Mapping

from ec_core.scheduler_process.allocator import BlockAllocator
from ec_core.stats import ENGINE, ECCPUConnectorStats, is_counter, labelled_key
from ec_scheduler.counters import SchedulerCounters


def stat_totals(
    counters: SchedulerCounters, allocator: BlockAllocator, worker_totals: Mapping[str, float]
) -> dict[str, float]:
    """Cumulative counters (stats names), per-rank copy counts and current gauges."""
    c = counters
    totals: dict[str, float] = {
        "lookups": c.lookups,
        "hits": c.hits,
        "misses": c.lookups - c.hits,
        "saves": c.saves_completed,
        "loads": c.loads_completed,
        "saves_failed": c.saves_failed,
        "save_fallbacks": c.save_fallbacks,
        "load_fallbacks": c.load_fallbacks,
        "saves_not_admitted": c.saves_not_admitted,
        "saves_skipped": c.saves_skipped_full
        + c.saves_skipped_oversize
        + c.saves_skipped_empty
        + c.saves_skipped_unmeasured,
        "evictions": c.evictions,
        "reclaimed": c.saves_reclaimed + c.loads_reclaimed,
        "reports_lost": c.reports_lost,
        "stale_dropped": c.stale_dropped,
        **worker_totals,
    }
    for op, per_rank in (
        ("save", c.saves_by_rank),
        ("load", c.loads_by_rank),
        ("save_fallback", c.save_fallbacks_by_rank),
        ("load_fallback", c.load_fallbacks_by_rank),
    ):
        for rank, count in per_rank.items():
            totals[labelled_key("rank_copies", op, rank)] = count
    totals["region_blocks"] = allocator.num_blocks
    totals["region_used_blocks"] = allocator.num_reserved_blocks - allocator.num_free_blocks
    totals["region_entries"] = len(allocator)
    totals["region_held_entries"] = allocator.num_held_entries
    totals.update(allocator.policy.stats())
    return totals


class StatsPublisher:
    """Remembers what was handed over, so each hand-over carries only what changed.

    Every hand-over names its engine (`engine`, the data-parallel rank), so a
    front end that folds several engines' stats into one log line can tell
    whose gauges it holds.
    """

    def __init__(self, engine: int = 0) -> None:
        self._engine = engine
        self._published: dict[str, float] = {}

    def changes(self, totals: Mapping[str, float]) -> ECCPUConnectorStats | None:
        """Counter deltas since the previous call plus every gauge; None when no counter moved."""
        data: dict[str, float] = {ENGINE: self._engine}
        moved = False
        for name, value in totals.items():
            if is_counter(name):
                delta = value - self._published.get(name, 0.0)
                if delta:
                    data[name] = delta
                    moved = True
            else:
                data[name] = value
        if not moved:
            return None
        self._published = {name: value for name, value in totals.items() if is_counter(name)}
        return ECCPUConnectorStats(data=data)
