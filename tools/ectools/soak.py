"""Randomised soak: one scheduler, four worker processes, one real region.

    python tools/ectools/soak.py [--steps 100000]     (hatch run soak)

The main process drives a real `ECCPUScheduler` with random requests (a pool
of 300 images of 1-40 rows, popular ones more often, now and then an image
whose content changed); four forked processes each run a real
`CpuECCPUWorker` over the same region (rank 0 saves, all ranks load). Every
payload is derived from (key, rows), so each rank checks every load it
performs byte for byte. Reports are occasionally lost or delivered a step
late, as a flaky executor would; with `kill_rank_at`, one worker process is
SIGKILLed mid-run and never reports again (its loads' pins must then be
reclaimed after the bound). At the end all late reports are delivered,
the report bound is allowed to pass, and the region is checked: every ready
entry's bytes are read back, no block is owned twice, free + owned = pool,
nothing is held. Prints the counts; exits 1 if anything is corrupted or leaked.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import zlib
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_core.region import ECSharedRegion
from ec_core.worker import RankInfo
from ec_scheduler import ECCPUScheduler
from ectools.configs import make_vllm_config
from ectools.driving import Item, StepDriver, connector_output, make_request, scheduler_output
from ectools.tiny_blip2 import write_config_only

WIDTH = 128  # the tiny BLIP-2 config's embedding width; fp32: one 512-byte block per row
RANKS = 4
POOL_KEYS = 300
REGION_BLOCKS = 400
BOUND_STEPS = 6


def payload(key: str, rows: int) -> torch.Tensor:
    """The encoder output every rank agrees `key` has when it has `rows` rows."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{key}:{rows}".encode()))
    return torch.randn(rows, WIDTH, generator=generator)


def _worker(config: Any, rank: int, pipe: Connection) -> None:
    torch.set_num_threads(1)  # a forked child must not enter torch's OpenMP pool
    from ec_worker_cpu.worker import CpuECCPUWorker

    worker = CpuECCPUWorker(config, rank_info=RankInfo(rank, rank == 0))
    pipe.send("ready")
    while True:
        meta = pipe.recv()
        if meta is None:
            break
        cache: dict[str, torch.Tensor] = {}
        worker.bind(meta)
        worker.start_load_caches(cache, meta)
        corrupted = 0
        for key, (_, _, (rows, _)) in meta.loads.items():
            if key not in cache or not torch.equal(cache[key], payload(key, rows)):
                corrupted += 1
        if rank == 0:
            for key, blocks in meta.saves.items():
                cache[key] = payload(key, len(blocks))
                worker.save_caches(cache, key, meta)
        worker.get_finished()
        pipe.send((worker.build_connector_worker_meta(), corrupted, len(meta.loads)))
    worker.shutdown()
    pipe.send("closed")


@dataclass
class SoakResult:
    steps: int = 0
    saves: int = 0
    loads_checked: int = 0
    corrupted_loads: int = 0
    reports_lost: int = 0
    reports_late: int = 0
    ranks_killed: int = 0
    reclaimed: int = 0
    evictions: int = 0
    stale_dropped: int = 0
    entries_verified_at_rest: int = 0
    corrupted_at_rest: int = 0
    leaked_blocks: int = 0
    held_at_end: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            self.corrupted_loads == 0
            and self.corrupted_at_rest == 0
            and self.leaked_blocks == 0
            and self.held_at_end == 0
        )


def run_soak(
    steps: int, *, seed: int = 0, workdir: str | None = None, kill_rank_at: int | None = None
) -> SoakResult:
    base = Path(workdir or tempfile.mkdtemp(prefix="ec-soak-"))
    (base / "region").mkdir(parents=True, exist_ok=True)
    config = make_vllm_config(
        write_config_only(base / "model"),
        extra={
            "ec_cpu_bytes": REGION_BLOCKS * WIDTH * 4,
            "ec_cpu_dir": str(base / "region"),
            "ec_report_timeout_steps": BOUND_STEPS,
            "ec_report_timeout_s": 0,
        },
        widths={"image": WIDTH},
    )
    rng = random.Random(seed)
    rows_of = {f"img{i}": rng.randint(1, 40) for i in range(POOL_KEYS)}
    weights = [1.0 / (i + 1) for i in range(POOL_KEYS)]
    context = mp.get_context("fork")
    pipes, procs = [], []
    for rank in range(RANKS):
        ours, theirs = context.Pipe()
        proc = context.Process(target=_worker, args=(config, rank, theirs), daemon=True)
        proc.start()
        pipes.append(ours)
        procs.append(proc)
    for pipe in pipes:
        assert pipe.recv() == "ready"
    scheduler = ECCPUScheduler(config)
    driver = StepDriver(scheduler)
    result = SoakResult(steps=steps)
    layout = scheduler.layout
    region = ECSharedRegion(  # this process joins to check the bytes at rest
        layout.engine_id,
        layout.num_blocks,
        layout.block_size_bytes,
        directory=layout.settings.region_dir,
        owner=layout.owner,
    )
    late: list[ECCPUWorkerReport] = []

    def deliver(reports: list[ECCPUWorkerReport]) -> None:
        if not reports:
            return
        head = reports[0]
        for other in reports[1:]:
            head.aggregate(other)
        scheduler.update_connector_output(connector_output(head))

    alive = list(pipes)

    def run_step(meta: ECCPUConnectorMetadata, *, flaky: bool) -> None:
        for pipe in alive:
            pipe.send(meta)
        arrived: list[ECCPUWorkerReport] = list(late)
        late.clear()
        for pipe in alive:
            report, corrupted, checked = pipe.recv()
            result.corrupted_loads += corrupted
            result.loads_checked += checked
            roll = rng.random() if flaky else 1.0
            if roll < 0.01:
                result.reports_lost += 1
            elif roll < 0.04:
                result.reports_late += 1
                late.append(report)
            else:
                arrived.append(report)
        deliver(arrived)

    try:
        for number in range(steps):
            if number == kill_rank_at:
                os.kill(procs[-1].pid, signal.SIGKILL)  # the last rank dies mid-run
                procs[-1].join(60)
                alive.remove(pipes[-1])
                result.ranks_killed += 1
            requests = []
            for r in range(rng.randint(1, 3)):
                keys = rng.choices(list(rows_of), weights=weights, k=rng.randint(1, 2))
                if rng.random() < 0.01:  # a reused UUID now names other content
                    rows_of[keys[0]] = rng.randint(1, 40)
                unique = list(dict.fromkeys(keys))
                requests.append(
                    make_request(f"s{number}r{r}", [Item(k, rows_of[k]) for k in unique])
                )
            run_step(driver.step(requests).meta, flaky=True)
        # Drain: late reports arrive, then the bound passes with idle steps.
        deliver(late)
        late.clear()
        for _ in range(BOUND_STEPS + 2):
            run_step(scheduler.build_connector_meta(scheduler_output()), flaky=False)
        _check_at_rest(scheduler, region, result)
    finally:
        for pipe in alive:
            pipe.send(None)
        for pipe in alive:
            pipe.recv()
        for proc in procs:
            proc.join(60)
        region.cleanup()
        scheduler.shutdown()
    return result


def _check_at_rest(scheduler: ECCPUScheduler, region: ECSharedRegion, result: SoakResult) -> None:
    counters = scheduler.counters
    result.saves = counters.saves_completed
    result.reclaimed = counters.saves_reclaimed + counters.loads_reclaimed
    result.evictions = counters.evictions
    result.stale_dropped = counters.stale_dropped
    allocator = scheduler.allocator
    allocator.check()  # no block owned twice; free + owned runs cover the pool
    owned = sum(entry.num_blocks for entry in allocator)
    result.leaked_blocks = allocator.num_blocks - allocator.num_free_blocks - owned
    result.held_at_end = allocator.num_held_entries + len(scheduler.flights.saves)
    for entry in allocator:
        if not entry.ready or entry.shape is None:
            continue
        data = region.blocks[entry.block_ids].view(torch.float32).reshape(-1)
        expected = payload(entry.key, entry.shape[0]).reshape(-1)
        result.entries_verified_at_rest += 1
        if not torch.equal(data[: expected.numel()], expected):
            result.corrupted_at_rest += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kill-rank-at", type=int, default=None, help="SIGKILL rank 3 at this step"
    )
    args = parser.parse_args()
    result = run_soak(args.steps, seed=args.seed, kill_rank_at=args.kill_rank_at)
    for name, value in vars(result).items():
        if name != "extra":
            print(f"{name:>26}: {value}")
    print("OK" if result.ok else "FAILED")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
