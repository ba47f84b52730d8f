"""How large should `ec_cpu_bytes` be? Replays an access log at several region sizes.

The `ec-cpu-sizing` command (`main`) reads an access log the scheduler wrote
(`ec_scheduler.access_log`), replays it through the tier's real
`BlockAllocator` and policy at each region size asked for, beside plain LRU,
the true-popularity oracle and Belady (`ec_scheduler.sizing_references`), and
prints a table of the byte hit ratio and the encoder runs saved against region
size; `--svg` also draws them. `docs/sizing.md` is the operator's guide.

Runs anywhere Python and ec-core run: it imports nothing from vLLM or torch.

An item's size in the replay is its region footprint: `ceil(bytes / block_bytes)`
blocks, `block_bytes` being what one block of the region holds (the log's header
says the engine's: one embedding row of the model). A key seen with several
sizes keeps its first. A region of S bytes holds `S // block_bytes` blocks.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from ec_core.policy_names import DEFAULT_POLICY, POLICY_NAMES
from ec_core.sizes import SizeError, format_bytes, parse_byte_size
from ec_scheduler.access_log_format import AccessRecords, read_log
from ec_scheduler.sizing_references import (
    BlockTrace,
    Result,
    run_belady,
    run_oracle,
    run_ours,
    run_plain_lru,
)

DEFAULT_FRACTIONS: tuple[float, ...] = (0.02, 0.05, 0.10, 0.20, 0.30, 0.50)
"""The region sizes tried without `--sizes`: fractions of the trace's working set."""

CACHES: tuple[str, ...] = ("ours", "plain LRU", "oracle", "Belady")
"""The columns of the table, in order; the plot draws the first three and Belady dashed."""


@dataclass(frozen=True)
class SizedTrace:
    """A `BlockTrace` with a name: keys in request order, each key's size in blocks."""

    name: str
    keys: list[str]
    sizes: dict[str, int]

    @property
    def working_set(self) -> int:
        """Blocks of all distinct items together."""
        return sum(self.sizes.values())

    @property
    def distinct(self) -> int:
        """Distinct items."""
        return len(self.sizes)


@dataclass(frozen=True)
class SizingRow:
    """One region size and what each cache did there (`CACHES` order)."""

    capacity: int
    """Blocks of the region."""
    results: dict[str, Result]


def trace_of_log(
    records: AccessRecords, block_bytes: int | None = None, name: str = "log"
) -> SizedTrace:
    """The log as a trace in blocks of `block_bytes` (default: the engine's)."""
    block = block_bytes if block_bytes is not None else records.block_bytes
    if block <= 0:
        raise ValueError(f"block bytes must be positive, got {block}")
    sizes: dict[str, int] = {}
    for digest, nbytes in zip(records.digests, records.nbytes, strict=True):
        if digest not in sizes:
            sizes[digest] = max(1, -(-nbytes // block))
    return SizedTrace(name, list(records.digests), sizes)


def default_capacities(
    trace: SizedTrace, fractions: Sequence[float] = DEFAULT_FRACTIONS
) -> list[int]:
    """Region sizes in blocks: `fractions` of the trace's working set (at least 1)."""
    working_set = trace.working_set
    return [max(1, int(working_set * fraction)) for fraction in fractions]


def parse_sizes(text: str, trace: SizedTrace, block_bytes: int) -> list[int]:
    """`--sizes`: comma-separated byte sizes (`8GiB`) or percentages of the working
    set (`5%`), as region blocks; ValueError on a bad one or one under a block."""
    working_set = trace.working_set
    capacities = []
    for part in (piece.strip() for piece in text.split(",")):
        if part.endswith("%"):
            try:
                percent = float(part[:-1])
            except ValueError:
                raise ValueError(f"--sizes: {part!r} is not a percentage") from None
            if not math.isfinite(percent) or percent <= 0:
                raise ValueError(f"--sizes: {part!r} is not a positive percentage")
            blocks = int(working_set * percent / 100)
        else:
            try:
                blocks = parse_byte_size(part) // block_bytes
            except SizeError as exc:
                raise ValueError(f"--sizes: {part!r}: {exc}") from None
        if blocks < 1:
            raise ValueError(f"--sizes: {part!r} holds less than one block ({block_bytes} bytes)")
        capacities.append(blocks)
    return capacities


def sweep(
    trace: BlockTrace, capacities: Sequence[int], policy: str = DEFAULT_POLICY
) -> list[SizingRow]:
    """Replay `trace` at each capacity (blocks) through every cache of `CACHES`."""
    rows = []
    for capacity in capacities:
        rows.append(
            SizingRow(
                capacity,
                {
                    "ours": run_ours(trace, capacity, policy),
                    "plain LRU": run_plain_lru(trace, capacity),
                    "oracle": run_oracle(trace, capacity),
                    "Belady": run_belady(trace, capacity),
                },
            )
        )
    return rows


def table(
    rows: Sequence[SizingRow], trace: SizedTrace, block_bytes: int, policy: str = DEFAULT_POLICY
) -> list[str]:
    """The table's lines: per region size (and its share of the working set), each
    cache's byte hit ratio, then the encoder runs it saved (requests served)."""
    working_set = trace.working_set
    names = " ".join(f"{_SHORT[name]:>7}" for name in CACHES)
    lines = [
        f"{len(trace.keys)} requests of {trace.distinct} distinct items; working set (WS) "
        f"{format_bytes(working_set * block_bytes)}, {working_set} blocks of {block_bytes} bytes",
        f"ours = the tier's allocator with policy {policy}; encoder runs saved = requests "
        "served from the region",
        f"{'':18} | {'byte hit ratio':^31} | {'encoder runs saved':^31}".rstrip(),
        f"{'region':>11} {'of WS':>6} | {names} | {names}",
    ]
    for row in rows:
        ratios = " ".join(f"{row.results[name].hit_ratio:>7.3f}" for name in CACHES)
        saved = " ".join(f"{row.results[name].hits:>7}" for name in CACHES)
        lines.append(
            f"{format_bytes(row.capacity * block_bytes):>11} "
            f"{_share(row.capacity, working_set):>6} | {ratios} | {saved}"
        )
    for reference in ("plain LRU", "oracle"):
        shares = ", ".join(
            f"{_ratio(row.results['ours'].hit_ratio, row.results[reference].hit_ratio)}"
            for row in rows
        )
        lines.append(f"byte hit ratio of ours / {reference}, size by size: {shares}")
    return lines


def _ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x" if reference else "-"


_SHORT = {"ours": "ours", "plain LRU": "LRU", "oracle": "oracle", "Belady": "Belady"}


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


SERIES_COLOURS = {
    **{f"ours ({policy})": "#1f77b4" for policy in POLICY_NAMES},
    "plain LRU": "#7f7f7f",
    "oracle": "#2ca02c",
    "Belady": "#d62728",
}


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 x 10^k at or above `value`
    (1 for a value <= 0 or not finite): a round top for an axis of four ticks."""
    if not value > 0 or not math.isfinite(value):
        return 1.0
    scale = 10.0 ** math.floor(math.log10(value))
    for step in (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0):
        if step * scale >= value * (1 - 1e-12):
            return step * scale
    return 10.0 * scale  # pragma: no cover - 10 x scale is always >= value


def y_grid_svg(left: float, right: float, top: float, height: float, y_max: float) -> list[str]:
    """The SVG of a y axis's five grid lines from 0 to `y_max` (at quarters), each
    labelled left of `left`; the plot spans `left`..`right`, `top`..`top + height`."""
    parts = []
    for tick in range(5):
        value = y_max * tick / 4
        y = top + height - height * tick / 4
        parts.append(
            f'<line x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{value:g}</text>'
        )
    return parts


@dataclass(frozen=True)
class Panel:
    """One chart of `line_chart_svg`: one y per x for each series, drawn from 0 to
    `y_max` (None: `nice_ceiling` of the largest finite value)."""

    title: str
    series: Mapping[str, Sequence[float]]
    y_max: float | None = None


def line_chart_svg(
    title: str,
    panels: Sequence[Panel],
    x_values: Sequence[float],
    x_labels: Sequence[str],
    *,
    x_title: str = "",
    dashed: frozenset[str] = frozenset(),
) -> str:
    """Line charts side by side as one standalone SVG (stdlib only).

    The x axis runs linearly from 0 to the largest x, with `x_labels` under their x;
    every series has one value per x, and a value that is not finite is left out of
    its line. Series named in `dashed` are drawn dashed.
    """
    if len(x_values) != len(x_labels):
        raise ValueError(f"{len(x_values)} x values for {len(x_labels)} labels")
    width, height, left, right, top, bottom = 390, 290, 60, 20, 48, 88
    x_max = max(x_values, default=0.0) or 1.0
    plot_w, plot_h = width - left - right, height - top - bottom
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(panels)}" '
        f'height="{height + 44}" font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{left}" y="18" font-size="13">{escape(title)}</text>',
    ]
    for index, panel in enumerate(panels):
        for name, values in panel.series.items():
            if len(values) != len(x_values):
                raise ValueError(f"series {name!r} has {len(values)} values for {len(x_values)}")
        x0 = index * width + left
        finite = [v for vs in panel.series.values() for v in vs if math.isfinite(v)]
        y_max = panel.y_max if panel.y_max is not None else nice_ceiling(max(finite, default=0))
        parts.append(
            f'<text x="{x0}" y="{top - 10}" font-size="12">{escape(panel.title)}</text>'
            f'<rect x="{x0}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" '
            'stroke="#bbb"/>'
            f'<text x="{x0 + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle">'
            f"{escape(x_title)}</text>"
        )
        parts.extend(y_grid_svg(x0, x0 + plot_w, top, plot_h, y_max))
        for x, label in zip(x_values, x_labels, strict=True):
            px, py = x0 + plot_w * x / x_max, top + plot_h + 12
            parts.append(
                f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{top + plot_h}" y2="{top + plot_h + 4}" '
                'stroke="#888"/>'
                f'<text x="{px:.1f}" y="{py}" text-anchor="end" '
                f'transform="rotate(-40 {px:.1f} {py})">{escape(label)}</text>'
            )
        for number, (name, values) in enumerate(panel.series.items()):
            colour = SERIES_COLOURS.get(name, "#ff7f0e")
            points = [
                (x0 + plot_w * x / x_max, top + plot_h * (1 - min(v, y_max) / y_max))
                for x, v in zip(x_values, values, strict=True)
                if math.isfinite(v)
            ]
            dash = ' stroke-dasharray="5 3"' if name in dashed else ""
            coords = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.8"{dash} '
                f'points="{coords}"/>'
            )
            parts.extend(
                f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.2" fill="{colour}"/>'
                for px, py in points
            )
            legend_x = x0 + (number % 2) * 160
            legend_y = height + 12 + (number // 2) * 15
            parts.append(
                f'<line x1="{legend_x}" x2="{legend_x + 18}" y1="{legend_y - 4}" '
                f'y2="{legend_y - 4}" stroke="{colour}" stroke-width="2"{dash}/>'
                f'<text x="{legend_x + 22}" y="{legend_y}">{escape(name)}</text>'
            )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def sizing_svg(
    rows: Sequence[SizingRow], block_bytes: int, title: str, policy: str = DEFAULT_POLICY
) -> str:
    """The plot: byte hit ratio (0 to 1), and encoder runs saved, against region size."""
    x_values = [float(row.capacity * block_bytes) for row in rows]
    labels = [format_bytes(row.capacity * block_bytes) for row in rows]
    shown = {name: f"ours ({policy})" if name == "ours" else name for name in CACHES}
    ratios = {shown[name]: [row.results[name].hit_ratio for row in rows] for name in CACHES}
    saved = {shown[name]: [float(row.results[name].hits) for row in rows] for name in CACHES}
    return line_chart_svg(
        title,
        [
            Panel("Byte hit ratio", ratios, y_max=1.0),
            Panel("Encoder runs saved (requests served)", saved),
        ],
        x_values,
        labels,
        x_title="region size (ec_cpu_bytes)",
        dashed=frozenset({"Belady"}),
    )


def report(
    trace: SizedTrace,
    block_bytes: int,
    capacities: Sequence[int] | None = None,
    policy: str = DEFAULT_POLICY,
) -> tuple[list[str], str]:
    """The table's lines and the plot's SVG for `trace` (default sizes: `DEFAULT_FRACTIONS`)."""
    sizes = list(capacities) if capacities is not None else default_capacities(trace)
    rows = sweep(trace, sizes, policy)
    lines = table(rows, trace, block_bytes, policy)
    title = f"{trace.name}: byte hit ratio and encoder runs saved against region size"
    return lines, sizing_svg(rows, block_bytes, title, policy)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ec-cpu-sizing",
        description=(
            "Replay an EC CPU tier access log (ec_access_log) at several region sizes "
            "through the tier's allocator and policy, beside plain LRU, the "
            "true-popularity oracle and Belady; print the byte hit ratio and the "
            "encoder runs saved per size."
        ),
    )
    parser.add_argument("--log", type=Path, required=True, help="the access log to replay")
    parser.add_argument(
        "--sizes",
        help="region sizes to try, comma-separated: bytes with a unit (8GiB, 8GB) or "
        "percentages of the log's working set (5%%); default "
        + ",".join(f"{fraction:.0%}" for fraction in DEFAULT_FRACTIONS),
    )
    parser.add_argument(
        "--block-bytes",
        type=int,
        help="bytes one region block holds (default: the engine's, from the log's header: "
        "one embedding row of the model)",
    )
    parser.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        choices=POLICY_NAMES,
        help=f"the tier's policy to replay (default {DEFAULT_POLICY})",
    )
    parser.add_argument("--svg", type=Path, help="also write the plot to this SVG file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The `ec-cpu-sizing` command; the exit status (2 on bad input)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        records = read_log(args.log)
        block_bytes = args.block_bytes if args.block_bytes is not None else records.block_bytes
        trace = trace_of_log(records, block_bytes, name=args.log.name)
        if not trace.keys:
            raise ValueError(f"{args.log}: the log holds no record")
        capacities = parse_sizes(args.sizes, trace, block_bytes) if args.sizes is not None else None
    except (OSError, ValueError) as exc:
        parser.exit(2, f"ec-cpu-sizing: {exc}\n")
    lines, svg = report(trace, block_bytes, capacities, args.policy)
    if records.dropped:
        lines.insert(
            0,
            f"note: the engine dropped {records.dropped} records of this log (its writer fell "
            "behind): the replay lacks them",
        )
    sys.stdout.write("\n".join(lines) + "\n")
    if args.svg is not None:
        args.svg.write_text(svg)
        sys.stdout.write(f"plot written to {args.svg}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
