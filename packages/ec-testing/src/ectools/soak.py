"""Randomised soak: one scheduler, four worker processes, one real region.

    python -m ectools.soak [--steps 100000]     (hatch run soak)

The main process drives a real `ECCPUScheduler` with random requests (a pool
of 300 images of 1-40 rows, popular ones more often, now and then an image
whose content changed); four forked processes each run a real
`CpuECCPUWorker` over the same region (rank 0 saves, all ranks load), whose
copies are made asynchronous: each batch lands 0 to 2 x bound + 2 steps after
it was submitted, in any order, some well past the report bound. Every
payload is derived from (key, rows), so each rank checks every load byte for
byte when it lands. Reports are occasionally lost or delivered a step late,
as a flaky executor would; with `kill_rank_at`, one worker process is
SIGKILLed mid-run and never reports again (it must be declared gone, and the
copies it owed no longer waited for). At the end all late reports are
delivered, every copy lands, and the region is checked: every ready entry's
bytes are read back, no block is owned twice, free + owned = pool, nothing
is held. Prints the counts; exits 1 if anything is corrupted or leaked.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_core.region.mapping import ECSharedRegion
from ec_core.worker_process.ranks import RankInfo
from ec_core.worker_process.transfer import DescriptorBatch, TransferDirection, TransferHandle
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


@dataclass
class _Delayed:
    """One batch of copies that lands when its step comes (or at once when due now)."""

    copies: list[tuple[int, int, int]]
    due: int
    on_landed: list[Callable[[], None]] = field(default_factory=list)
    landed: bool = False

    def land(self) -> None:
        if not self.landed:
            for src, dst, size in self.copies:
                ctypes.memmove(dst, src, size)
            self.landed = True
            for callback in self.on_landed:
                callback()

    # TransferHandle
    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.land()

    def release(self) -> None:
        return None

    def elapsed_seconds(self) -> float | None:
        return None


def _copy_delay(rng: random.Random) -> int:
    """Steps until a batch lands: mostly at once, sometimes well past the report bound."""
    roll = rng.random()
    if roll < 0.70:
        return 0
    if roll < 0.90:
        return rng.randint(1, 2)
    if roll < 0.98:
        return rng.randint(3, BOUND_STEPS)
    return rng.randint(BOUND_STEPS + 1, 2 * BOUND_STEPS + 2)


def _worker(config: Any, rank: int, seed: int, pipe: Connection) -> None:
    torch.set_num_threads(1)  # a forked child must not enter torch's OpenMP pool
    from ec_worker_cpu.worker import CpuECCPUWorker

    rng = random.Random(seed * 1000 + rank)
    step = [0]
    pending: list[_Delayed] = []
    stats = {"corrupted": 0, "checked": 0, "past_bound": 0}

    class DelayedCpuWorker(CpuECCPUWorker):
        """The CPU backend with asynchronous copies that land some steps later."""

        def _submit_transfer(
            self,
            batch: DescriptorBatch,
            direction: TransferDirection,
            keepalive: Sequence[torch.Tensor],
        ) -> TransferHandle:
            delay = _copy_delay(rng)
            stats["past_bound"] += delay > BOUND_STEPS
            handle = _Delayed(list(batch), step[0] + delay)
            pending.append(handle)
            return handle

    def check_on_landing(handle: _Delayed, loads: list[tuple[str, torch.Tensor, int]]) -> None:
        # Like a device's compute stream, the consumer reads a load only once it has landed.
        def check() -> None:
            for key, tensor, rows in loads:
                stats["checked"] += 1
                if not torch.equal(tensor, payload(key, rows)):
                    stats["corrupted"] += 1

        handle.on_landed.append(check)

    def land_due() -> None:
        due = [h for h in pending if h.due <= step[0]]
        rng.shuffle(due)  # batches of different steps land in any order
        for handle in due:
            handle.land()
            pending.remove(handle)

    worker = DelayedCpuWorker(config, rank_info=RankInfo(rank, rank == 0, RANKS))
    pipe.send("ready")
    while True:
        meta = pipe.recv()
        if meta is None:
            break
        step[0] += 1
        cache: dict[str, torch.Tensor] = {}
        worker.bind(meta)
        submitted = len(pending)
        worker.start_load_caches(cache, meta)
        if len(pending) > submitted:
            loads = [(key, cache[key], rows) for key, (_, _, (rows, _)) in meta.loads.items()]
            check_on_landing(pending[-1], loads)
        if rank == 0:
            for key, (rows, _) in meta.save_shapes.items():
                cache[key] = payload(key, rows)
                worker.save_caches(cache, key, meta)
        worker.get_finished()
        land_due()
        pipe.send(worker.build_connector_worker_meta())
    for handle in pending:
        handle.land()
    worker.shutdown()
    pipe.send(stats)


@dataclass
class SoakResult:
    steps: int = 0
    saves: int = 0
    loads_checked: int = 0
    corrupted_loads: int = 0
    reports_lost: int = 0
    """Worker reports the flaky executor dropped."""
    reports_late: int = 0
    """Worker reports it delivered a step late."""
    ranks_killed: int = 0
    copies_past_bound: int = 0
    """Batches that landed more steps after submission than the report bound."""
    overdue: int = 0
    """Copies the scheduler found unreported past the bound (their blocks stayed held)."""
    settled_without_report: int = 0
    """Copies the scheduler settled because their rank had moved past them."""
    evictions: int = 0
    split_copies: int = 0
    """Saves and loads of entries lying in more than one run of blocks (several descriptors)."""
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
        proc = context.Process(target=_worker, args=(config, rank, seed, theirs), daemon=True)
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
        result.split_copies += sum(len(runs) > 1 for runs in meta.runs.values())
        for pipe in alive:
            pipe.send(meta)
        arrived: list[ECCPUWorkerReport] = list(late)
        late.clear()
        for pipe in alive:
            report = pipe.recv()
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
        # Drain: late reports arrive, then idle steps until every delayed copy
        # has landed and been reported.
        deliver(late)
        late.clear()
        for _ in range(2 * BOUND_STEPS + 4):
            run_step(scheduler.build_connector_meta(scheduler_output()), flaky=False)
        _check_at_rest(scheduler, region, result)
    finally:
        for pipe in alive:
            pipe.send(None)
        for pipe in alive:
            stats = pipe.recv()
            result.loads_checked += stats["checked"]
            result.corrupted_loads += stats["corrupted"]
            result.copies_past_bound += stats["past_bound"]
        for proc in procs:
            proc.join(60)
        region.cleanup()
        scheduler.shutdown()
    return result


def _check_at_rest(scheduler: ECCPUScheduler, region: ECSharedRegion, result: SoakResult) -> None:
    counters = scheduler.counters
    result.saves = counters.saves_completed
    result.overdue = counters.saves_reclaimed + counters.loads_reclaimed
    result.settled_without_report = counters.reports_lost
    result.evictions = counters.evictions
    result.stale_dropped = counters.stale_dropped
    allocator = scheduler.allocator
    allocator.check()  # no block owned twice; free + owned runs cover the pool
    owned = sum(entry.num_blocks for entry in allocator)
    result.leaked_blocks = allocator.num_blocks - allocator.num_free_blocks - owned
    result.held_at_end = (
        allocator.num_held_entries + len(scheduler.flights.saves) + len(scheduler.flights.loads)
    )
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
