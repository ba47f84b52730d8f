"""All local benchmark tables in one run, printed and written to the docs site.

    hatch run bench-all [--page PATH]

Table 1 byte hit ratio (ours, vLLM's in-tree cache, plain LRU, Belady) on
Zipf, Zipf+scans and chat traces at 5/10/20 % of the working set; the sweep
(`sweep.py`: the policy's goals over seeds, lengths of 10k-1M requests,
capacities of 2-30 % and four item-size distributions); Table 2 descriptors
per entry and allocation time after long churn; Table 3 scheduler cost per
engine step; Table 4 CPU backend copy throughput vs memcpy; Table 6 how long
region creation blocks the engine's start against region size. The workloads
are described in `workloads.py`; every trace is seeded.

The run ends with "Goals (issue 36)" (`goals.py`): one line per goal of issue
36, with the figure this run measured, the goal and PASS or FAIL, computed from
the numbers the tables' functions hand back.

Besides printing, the run writes the results page of the docs site
(`docs/benchmarks/results.md`, see `results_page.py`) with its date, machine
and command, and Table 1's plot beside it (`hit-ratio.svg`); with the default
`--page` it also regenerates the sizing page's figure and table
(`docs/sizing.svg`, `docs/sizing.md`, see `sizing.py`). None of them is ever
edited by hand.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import vllm

import goals
import results_page
import sizing
import startup
import sweep

import copy_throughput
import fragmentation
import hit_ratio
import scheduler_cost

COMMAND = "hatch run bench-all"
HIT_RATIO_FIGURE = "hit-ratio.svg"
"""Table 1's plot, written next to the results page."""


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
    rows: list[hit_ratio.Row] = []
    measured: list[sweep.Measured] = []
    summaries: list[sweep.Summary] = []
    allocation: list[fragmentation.Row] = []
    steps: list[scheduler_cost.Row] = []
    parts: list[tuple[Callable[[], list[str]], str | None]] = [
        (lambda: hit_ratio.table(rows=rows), HIT_RATIO_FIGURE),
        (lambda: sweep.table(summaries=summaries, record=measured), None),
        (lambda: fragmentation.table(rows=allocation), None),
        (lambda: scheduler_cost.table(rows=steps), None),
        (copy_throughput.table, None),
        (startup.table, None),
    ]
    tables = []
    for part, figure in parts:
        began = time.perf_counter()
        lines = part()
        seconds = time.perf_counter() - began
        print()
        print("\n".join(lines))
        print(f"({seconds:.0f} s)")
        tables.append(results_page.Table(lines, seconds, figure))
    lines = goals.lines(
        [
            *goals.table1(rows),
            *goals.independent(measured, sweep.GOALS),
            *goals.swept(summaries, sweep.GOALS),
            *goals.scheduler_step(steps),
            *goals.allocation(allocation),
        ]
    )
    print()
    print("\n".join(lines))
    tables.append(results_page.Table(lines, None))
    command = " ".join([COMMAND, *sys.argv[1:]])
    page = results_page.render(
        date=date, machine=machine, versions=versions, command=command, load=load, tables=tables
    )
    figures = {HIT_RATIO_FIGURE: hit_ratio_chart(rows)}
    print(f"\nwrote {results_page.write(page, args.page, figures)}", file=sys.stderr)
    if args.page == results_page.PAGE:  # the docs site's own run: its sizing page too
        sizing.write_docs()
        print(f"wrote {sizing.DOCS_PAGE} and {sizing.DOCS_FIGURE}", file=sys.stderr)


def hit_ratio_chart(rows: list[hit_ratio.Row]) -> str:
    """Table 1 as bars: each policy's byte hit ratio as a fraction of Belady's."""
    return results_page.bar_chart_svg(
        "Table 1 - byte hit ratio as a fraction of Belady's",
        [f"{row.workload} {row.capacity:.0%}" for row in rows],
        {
            f"ours ({hit_ratio.DEFAULT_POLICY})": [row.ours for row in rows],
            "in-tree": [row.in_tree for row in rows],
            "plain LRU": [row.lru for row in rows],
        },
        y_max=1.0,
    )


if __name__ == "__main__":
    main()
