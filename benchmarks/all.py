"""All four benchmark tables in one run.

    hatch run bench-all

Table 1 byte hit ratio (ours, vLLM's in-tree cache, plain LRU, Belady) on
Zipf, Zipf+scans and chat traces at 5/10/20 % of the working set; Table 2
descriptors per entry and allocation time after long churn; Table 3 scheduler
cost per engine step; Table 4 CPU backend copy throughput vs memcpy; Table 6
how long region creation blocks the engine's start against region size. The
workloads are described in `workloads.py`; every trace is seeded.
"""

from __future__ import annotations

import os
import platform
import time

import torch
import vllm

import startup

import copy_throughput
import fragmentation
import hit_ratio
import scheduler_cost


def main() -> None:
    print(
        f"EC CPU tier benchmarks, {time.strftime('%Y-%m-%d')}: {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}, "
        f"vLLM {vllm.__version__}"
    )
    for part in (hit_ratio, fragmentation, scheduler_cost, copy_throughput, startup):
        began = time.perf_counter()
        lines = part.table()
        print()
        print("\n".join(lines))
        print(f"({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
