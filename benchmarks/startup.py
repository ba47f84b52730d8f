"""Table 6 - start-up: how long creating the region blocks the engine's start, by size.

For the CPU backend, which registers nothing: a backend that pins the whole
mapping (CUDA, Ascend) or an engine with cross-engine peers (NIXL registers
the region) reserves every page before it starts, i.e. the "sync reserve" column.

For each region size, in one run and in the same directory (a fresh folder
under /dev/shm, removed afterwards), alternating, every figure timed from
before `open()` of the file:

* plain fallocate  - open, `ftruncate` and `posix_fallocate` of a file of that
  size, nothing else (no pre-faulting, no header, no mapping);
* sync reserve     - `ECSharedRegion(..., background_reserve=False)`: every page
  reserved and pre-faulted before the constructor returns (what start-up does
  where the region is registered);
* ours: blocks     - the time `ECSharedRegion(..., background_reserve=True)`
  blocks its caller (the engine's start): it reserves and pre-faults the first
  `SYNC_RESERVE_BYTES` and returns;
* ours: reserved+faulted - from the same start until the background thread
  has reserved and pre-faulted every block, i.e. until the cache has its full
  size (the engine serves, with a cache growing from the front, meanwhile).

A size runs only when the directory and the machine's available memory both
hold it with a quarter of the machine's memory (at least 4 GiB) to spare, and
when its estimated cost (the previous size's, scaled) fits the run's time
budget; the others are skipped with the reason printed. Sizes up to
`REPEAT_MAX_GIB` are measured `REPEATS` times, the three methods alternating,
and each figure is the median; larger sizes are one measurement each.

    hatch run bench-startup [--max-gib N] [--budget-s S]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ec_core.region import page_reserver
from ec_core.region.mapping import ECSharedRegion
from ec_core.sizes import format_bytes

GIB = 1 << 30
SIZES_GIB = (1, 2, 4, 8, 16, 32, 64)
MIN_HEADROOM = 4 * GIB
"""Memory and directory space left free for everything else (at least; see `_headroom`)."""
BUDGET_S = 60.0
REPEATS = 3
REPEAT_MAX_GIB = 2
BLOCK = 8192  # one bf16 row of a 4096-wide model
SHM = Path("/dev/shm")


def _available_memory() -> int:
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _headroom() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(MIN_HEADROOM, total // 4)


def _directory_free(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _plain_fallocate(directory: Path, size: int) -> float:
    path = directory / "plain.bin"
    began = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        return time.perf_counter() - began
    finally:
        os.close(fd)
        path.unlink()


def _region(directory: Path, size: int, *, background: bool) -> tuple[float, float, int, int]:
    """(blocked s, fully reserved s, reserved blocks, blocks) of one `ECSharedRegion`."""
    began = time.perf_counter()
    region = ECSharedRegion(
        "startup_bench", size // BLOCK, BLOCK, directory=directory, background_reserve=background
    )
    blocked = time.perf_counter() - began
    try:
        region.wait_reserved()
        reserved = time.perf_counter() - began
        return blocked, reserved, region.reserved_blocks, region.num_blocks
    finally:
        region.cleanup()


def _measure(directory: Path, size: int, repeats: int) -> tuple[list[float], int, int]:
    """Medians of (plain, sync reserve, ours blocked, ours reserved), and the last
    background run's (reserved blocks, blocks)."""
    samples: list[list[float]] = [[], [], [], []]
    reserved, blocks = 0, 0
    for _ in range(repeats):
        samples[0].append(_plain_fallocate(directory, size))
        samples[1].append(_region(directory, size, background=False)[0])
        blocked, reserved_s, reserved, blocks = _region(directory, size, background=True)
        samples[2].append(blocked)
        samples[3].append(reserved_s)
    return [statistics.median(column) for column in samples], reserved, blocks


def table(max_gib: int | None = None, budget_s: float = BUDGET_S) -> list[str]:
    """The table's lines; sizes that cannot run here say why instead of a figure."""
    directory = Path(tempfile.mkdtemp(prefix="ec_startup_bench_", dir=SHM))
    headroom = _headroom()
    started = time.perf_counter()
    seconds_per_gib: float | None = None
    lines = [
        f"Table 6 - start-up: time region creation blocks the caller, by region size, "
        f"CPU backend (no registration; {SHM}, {os.cpu_count()} CPUs; synchronous front "
        f"{format_bytes(page_reserver.SYNC_RESERVE_BYTES)}, chunks of "
        f"{format_bytes(page_reserver.CHUNK_BYTES)}; medians of {REPEATS} alternating runs "
        f"up to {REPEAT_MAX_GIB} GiB)",
        f"{'size':>7} {'plain fallocate':>16} {'sync reserve':>14} {'ours: blocks':>13} "
        f"{'ours: reserved+faulted':>23}",
    ]
    try:
        for gib in SIZES_GIB:
            size = gib * GIB
            label = f"{gib} GiB"
            if max_gib is not None and gib > max_gib:
                lines.append(f"{label:>7}   skipped: above --max-gib {max_gib}")
                continue
            memory, free = _available_memory(), _directory_free(directory)
            if size + headroom > min(memory, free):
                lines.append(
                    f"{label:>7}   skipped: needs {format_bytes(size + headroom)} (size + "
                    f"{format_bytes(headroom)} headroom); {format_bytes(memory)} of memory "
                    f"available, {format_bytes(free)} free in {SHM}"
                )
                continue
            elapsed = time.perf_counter() - started
            repeats = REPEATS if gib <= REPEAT_MAX_GIB else 1
            estimate = None if seconds_per_gib is None else seconds_per_gib * gib * repeats
            if estimate is not None and elapsed + estimate > budget_s:
                lines.append(
                    f"{label:>7}   skipped: estimated {estimate:.0f} s, over the "
                    f"run's {budget_s:.0f} s budget ({elapsed:.0f} s used; --budget-s to raise)"
                )
                continue
            began = time.perf_counter()
            (plain, sync, blocked, reserved_s), reserved, blocks = _measure(
                directory, size, repeats
            )
            seconds_per_gib = (time.perf_counter() - began) / gib / repeats
            note = "" if reserved == blocks else f"  (stopped at {reserved} of {blocks} blocks)"
            lines.append(
                f"{label:>7} {plain:>14.2f} s {sync:>12.2f} s {blocked:>11.3f} s "
                f"{reserved_s:>21.2f} s{note}"
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    lines.append(
        "ours: blocks = what the CPU backend's start waits for; ours: reserved+faulted = until "
        "the cache has its full size, pre-faulting included (it serves from the reserved front "
        "meanwhile); sync reserve = what a registering backend (CUDA, Ascend, NIXL peers) "
        "waits for"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--max-gib", type=int, default=None, help="largest size to try")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="time budget of the run")
    args = parser.parse_args()
    print("\n".join(table(args.max_gib, args.budget_s)))


if __name__ == "__main__":
    main()
