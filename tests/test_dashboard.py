"""The Grafana dashboard names only families the tier exports, and covers what operators watch."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ec_core.stats import COUNTERS, GAUGES, LABELLED, PREFIX

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "ec-cpu-tier.json"


def _expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def test_every_series_the_dashboard_queries_is_exported() -> None:
    exported = {f"{PREFIX}{name}_total" for name in (*COUNTERS, *LABELLED)} | {
        f"{PREFIX}{name}" for name in GAUGES
    }
    used = {m for expr in _expressions() for m in re.findall(r"vllm:ec_cpu_\w+", expr)}
    assert used, "the dashboard queries nothing"
    assert used <= exported, sorted(used - exported)


def test_the_dashboard_shows_hits_bytes_copy_time_occupancy_evictions_and_reclaims() -> None:
    used = " ".join(_expressions())
    for family in (
        "hits_total",
        "lookups_total",
        "bytes_saved_total",
        "bytes_loaded_total",
        "save_copy_seconds_total",
        "load_copy_seconds_total",
        "region_used_blocks",
        "region_blocks",
        "evictions_total",
        "policy_lru_mode",
        "reclaimed_total",
    ):
        assert f"{PREFIX}{family}" in used, family


def test_the_dashboard_filters_by_vllms_model_label() -> None:
    """vLLM labels its families with model_name and engine; every query selects on the former."""
    for expr in _expressions():
        for selector in re.findall(r"vllm:ec_cpu_\w+(\{[^}]*\})?", expr):
            assert selector == '{model_name=~"$model_name"}', expr


def test_the_rendered_plot_computes_the_dashboards_rates(tmp_path: Path) -> None:
    import xml.etree.ElementTree as ET

    from ectools import metrics_plot

    def sample(t: float, hits: float, lookups: float, used: float) -> metrics_plot.Sample:
        return (
            t,
            {
                "vllm:ec_cpu_hits_total": hits,
                "vllm:ec_cpu_lookups_total": lookups,
                "vllm:ec_cpu_region_used_blocks": used,
                "vllm:ec_cpu_region_blocks": 100.0,
            },
        )

    first, second = sample(0.0, 0, 0, 10), sample(2.0, 3, 4, 40)
    hit_rate = metrics_plot.ratio(metrics_plot.rate("hits"), metrics_plot.rate("lookups"))
    assert metrics_plot.rate("hits")(first, second) == 1.5
    assert hit_rate(first, second) == 0.75
    assert hit_rate(second, sample(3.0, 3, 4, 40)) is None  # no lookups: undefined, not 0
    assert metrics_plot.gauge_ratio("region_used_blocks", "region_blocks")(first, second) == 0.4

    path = tmp_path / "plot.svg"
    metrics_plot.render_svg(
        [first, second, sample(3.0, 5, 6, 50)], metrics_plot.serving_panels(), path, "t"
    )
    root = ET.parse(path).getroot()
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 4  # hit rate; saved and loaded; occupancy
    assert all(line.get("points") for line in (lines[0], lines[3]))
