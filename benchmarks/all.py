"""All local benchmark tables in one run, printed and written to the docs site.

    hatch run bench-all [--page PATH]

Table 1 byte hit ratio (ours, vLLM's in-tree cache, plain LRU, Belady) on
Zipf, Zipf+scans and chat traces at 5/10/20 % of the working set; Table 2
descriptors per entry and allocation time after long churn; Table 3 scheduler
cost per engine step; Table 4 CPU backend copy throughput vs memcpy; Table 6
how long region creation blocks the engine's start against region size. The
workloads are described in `workloads.py`; every trace is seeded.

Besides printing, the run writes the results page of the docs site
(`docs/benchmarks/results.md`, see `results_page.py`) with its date, machine
and command; that page is never edited by hand.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import vllm

import results_page
import startup

import copy_throughput
import fragmentation
import hit_ratio
import scheduler_cost

COMMAND = "hatch run bench-all"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--page", type=Path, default=results_page.PAGE, help="where to write the results page"
    )
    args = parser.parse_args()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    machine = results_page.machine()
    versions = f"torch {torch.__version__}, vLLM {vllm.__version__}"
    load = results_page.load_average()
    print(f"EC CPU tier benchmarks, {date}: {machine}, {versions}")
    tables = []
    for part in (hit_ratio, fragmentation, scheduler_cost, copy_throughput, startup):
        began = time.perf_counter()
        lines = part.table()
        seconds = time.perf_counter() - began
        print()
        print("\n".join(lines))
        print(f"({seconds:.0f} s)")
        tables.append(results_page.Table(lines, seconds))
    command = " ".join([COMMAND, *sys.argv[1:]])
    page = results_page.render(
        date=date, machine=machine, versions=versions, command=command, load=load, tables=tables
    )
    print(f"\nwrote {results_page.write(page, args.page)}", file=sys.stderr)


if __name__ == "__main__":
    main()
