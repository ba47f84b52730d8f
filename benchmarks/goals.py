"""The goals of issue 36, each computed from the numbers of one `bench-all` run.

`hatch run bench-all` ends with the section "Goals (issue 36)": one line per goal
with the figure measured in that run, the goal, and PASS or FAIL. Nothing is parsed
from text: each check reads the rows the tables' functions hand back
(`hit_ratio.Row`, `fragmentation.Row`, `scheduler_cost.Row`, the sweep's
`sweep.Measured` and `sweep.Summary`).

* Table 1: ours >= 0.95 x the oracle on every IRM Zipf row (zipf a=...), >= 0.9 x
  the oracle on the loop rows and on the video rows, and no row below 0.99 x
  plain LRU;
* the two independent traces of `sweep.py` at the length and capacity the issue
  states them (100 000 requests; Zipf 0.9 + scans at 10 %, chat at 5 %), on each
  of the sweep's seeds: ours >= 0.92 x Belady (the line also gives the exact-count
  LFU's ratio to Belady: how far counting alone goes), and >= 0.99 x plain LRU;
* the sweep: each of `sweep.GOALS` at every point of its families;
* Table 3: a scheduler step of ours <= 1.0 x the in-tree one at every size, with
  images of one size and with mixed sizes (the median of the per-run ratios of
  interleaved runs);
* Table 2: a save (allocation) of ours <= 0.5 x the in-tree one at every region
  size (the median of the per-run ratios).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sweep

    import fragmentation
    import hit_ratio
    import scheduler_cost

TITLE = "Goals (issue 36)"
STEP_GOAL = 1.0
"""A scheduler step of ours costs at most this times the in-tree one, at every size."""
SAVE_GOAL = 0.5
"""A save of ours costs at most this times the in-tree one, at every region size."""
TABLE1_ORACLE_GOALS = (
    ("Table 1 IRM Zipf rows", "zipf a=", 0.95),
    ("Table 1 loop rows", "loop", 0.9),
    ("Table 1 video rows", "video", 0.9),
)
"""(what, workload name prefix, minimum of ours / oracle) per Table 1 goal."""
TABLE1_LRU_GOAL = 0.99


@dataclass(frozen=True)
class Check:
    """One goal: what it is about, the figure measured, the goal, and whether it is met."""

    name: str
    measured: str
    goal: str
    passed: bool


def lines(checks: Sequence[Check]) -> list[str]:
    """The goals section: a title, one line per goal, and how many are met."""
    width = max((len(check.name) for check in checks), default=4)
    measured = max((len(check.measured) for check in checks), default=8)
    met = sum(check.passed for check in checks)
    return [
        TITLE,
        f"{'goal':<{width}}  {'verdict':<7}  {'measured':<{measured}}  target",
        *(
            f"{check.name:<{width}}  {'PASS' if check.passed else 'FAIL':<7}  "
            f"{check.measured:<{measured}}  {check.goal}"
            for check in checks
        ),
        f"{met} of {len(checks)} goals met",
    ]


def table1(rows: Sequence[hit_ratio.Row]) -> list[Check]:
    """Table 1's goals: near the oracle on Zipf, loop and video rows; never below LRU.
    An oracle goal's line also says how the exact-count LFU (`hit_ratio.run_exact_lfu`)
    fares: where counting alone falls short, the goal asks more than learning counts."""
    checks = []
    for name, prefix, threshold in TABLE1_ORACLE_GOALS:
        chosen = [row for row in rows if row.workload.startswith(prefix)]
        if not chosen:
            continue
        worst = min(chosen, key=lambda row: row.ours_per_oracle)
        exact = sum(1 for row in chosen if row.exact_lfu_per_oracle >= threshold)
        checks.append(
            Check(
                name,
                f"min {worst.ours_per_oracle:.3f} x oracle ({worst.workload} {worst.capacity:.0%}"
                f"; exact LFU there {worst.exact_lfu_per_oracle:.3f}, meets it on {exact} of "
                f"{len(chosen)} rows)",
                f"ours >= {threshold} x oracle",
                all(row.ours_per_oracle >= threshold for row in chosen),
            )
        )
    if rows:
        worst = min(rows, key=lambda row: row.ours_per_lru)
        below = sum(1 for row in rows if row.ours_per_lru < TABLE1_LRU_GOAL)
        checks.append(
            Check(
                "Table 1 every row",
                f"min {worst.ours_per_lru:.3f} x LRU ({worst.workload} {worst.capacity:.0%}); "
                f"{below} of {len(rows)} below",
                f"ours >= {TABLE1_LRU_GOAL} x plain LRU",
                below == 0,
            )
        )
    return checks


def independent(measured: Sequence[sweep.Measured], goals: Sequence[sweep.Goal]) -> list[Check]:
    """The independent families' goals at the length and capacity the issue states them
    (`sweep.STATED`), with the default sizes, on every seed the sweep ran; a goal against
    Belady also gives the exact-count LFU's ratio on each seed, and the lowest of the
    oracle's (what a policy that knew every item's count in advance would make)."""
    import sweep

    import workloads

    checks = []
    for family, (length, capacity) in sweep.STATED.items():
        points = sorted(
            (
                result
                for result in measured
                if result.point.family == family
                and result.point.length == length
                and result.point.capacity == capacity
                and result.point.sizes == workloads.LOG_UNIFORM.name
            ),
            key=lambda result: result.point.seed,
        )
        for goal in goals:
            if goal.families != (family,) or not points:
                continue
            ratios = [result.ratio(goal.reference) for result in points]
            measured_line = (
                f"{min(ratios):.3f} x {sweep.REFERENCES[goal.reference]} (seeds "
                + _per_seed(points, ratios)
                + ")"
            )
            exact = sweep.exact_lfu_ratios(goal.reference, points)
            if exact is not None:
                measured_line += (
                    f"; exact LFU {min(exact):.3f} x {sweep.REFERENCES[goal.reference]} "
                    f"({_per_seed(points, exact)})"
                )
            if goal.reference == "belady":
                oracle = min(result.ratio("belady", "oracle") for result in points)
                measured_line += f"; the oracle {oracle:.3f} x Belady"
            checks.append(
                Check(
                    f"{family} {length // 1000}k at {capacity:.0%}",
                    measured_line,
                    goal.describe(),
                    all(ratio >= goal.threshold for ratio in ratios),
                )
            )
    return checks


def _per_seed(points: Sequence[sweep.Measured], ratios: Sequence[float]) -> str:
    """Each point's seed and ratio, in order ("101: 0.883, 102: 0.890")."""
    return ", ".join(
        f"{result.point.seed}: {ratio:.3f}" for result, ratio in zip(points, ratios, strict=True)
    )


def swept(summaries: Sequence[sweep.Summary], goals: Sequence[sweep.Goal]) -> list[Check]:
    """Each sweep goal over every point of its families: the worst ratio, where, and how
    many points miss (for a goal against the oracle or Belady, also how many the
    exact-count LFU misses; for one against Belady, how many the oracle misses)."""
    checks = []
    for goal in goals:
        found = [summary for summary in summaries if summary.goal == goal]
        if not found:
            continue
        worst = min(found, key=lambda summary: summary.minimum)
        failing = sum(summary.failing for summary in found)
        points = sum(summary.points for summary in found)
        notes = []
        for name, counts in (
            ("exact LFU", [summary.exact_lfu_failing for summary in found]),
            ("oracle", [summary.oracle_failing for summary in found]),
        ):
            known = [count for count in counts if count is not None]
            if known and len(known) == len(counts):
                notes.append(f"{name}: {sum(known)}")
        exact_note = f" ({'; '.join(notes)})" if notes else ""
        checks.append(
            Check(
                f"sweep: {goal.name}",
                f"min {worst.minimum:.3f} ({worst.family}, {worst.worst.describe()}); "
                f"{failing}{exact_note} of {points} points below",
                goal.describe(),
                failing == 0,
            )
        )
    return checks


def scheduler_step(rows: Sequence[scheduler_cost.Row]) -> list[Check]:
    """Table 3: ours / in-tree per step at every size, with images of one size and with
    mixed sizes (one check: the goal is a step never slower, whatever the images)."""
    checks = []
    for mixed in (False, True):
        checks += _at_every_size(
            "Table 3 scheduler step",
            [(row.ratio, str(row.items)) for row in rows if row.mixed == mixed],
            "at {} items" + (", mixed sizes" if mixed else ""),
            STEP_GOAL,
        )
    if len(checks) < 2:
        return checks
    one, mixed_sizes = checks
    return [
        Check(
            one.name,
            f"{one.measured}; {mixed_sizes.measured}",
            one.goal,
            one.passed and mixed_sizes.passed,
        )
    ]


def allocation(rows: Sequence[fragmentation.Row]) -> list[Check]:
    """Table 2: ours / in-tree per save at every region size."""
    return _at_every_size(
        "Table 2 allocation (save)",
        [(row.save_ratio, str(row.region_bits)) for row in rows],
        "at 2^{} blocks",
        SAVE_GOAL,
    )


def _at_every_size(
    name: str, ratios: Sequence[tuple[float, str]], sizes: str, goal: float
) -> list[Check]:
    """One check: every (ours / in-tree ratio, size label) at or under `goal`."""
    if not ratios:
        return []
    return [
        Check(
            name,
            " / ".join(f"{ratio:.2f}" for ratio, _ in ratios)
            + " x in-tree "
            + sizes.format("/".join(label for _, label in ratios)),
            f"ours <= {goal} x in-tree at every size",
            all(ratio <= goal for ratio, _ in ratios),
        )
    ]
