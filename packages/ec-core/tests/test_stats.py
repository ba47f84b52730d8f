"""Stats objects and Prometheus families of the connector."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ec_core.stats import COUNTERS, GAUGES, ECCPUConnectorStats, ECCPUPromMetrics


def test_stats_aggregate_sums_counters_and_keeps_newest_gauges() -> None:
    first = ECCPUConnectorStats(data={"hits": 2, "lookups": 5, "region_entries": 7})
    second = ECCPUConnectorStats(data={"hits": 3, "lookups": 5, "region_entries": 9})
    assert first.aggregate(second) is first
    assert first.data == {"hits": 5, "lookups": 10, "region_entries": 9}
    figures = first.reduce()
    assert figures["hit_rate"] == 0.5
    assert figures["region_entries"] == 9
    assert not first.is_empty()
    first.reset()
    assert first.is_empty() and first.data == {}


def test_gauges_alone_are_empty() -> None:
    assert ECCPUConnectorStats(data={"region_blocks": 10}).is_empty()


def test_every_metric_has_help_text_and_distinct_names() -> None:
    assert not set(COUNTERS) & set(GAUGES)
    assert all(text for text in (*COUNTERS.values(), *GAUGES.values()))


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def _metric_types(registry: CollectorRegistry) -> dict[type[Any], Any]:
    return {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }


def test_prometheus_families_per_engine(registry: CollectorRegistry) -> None:
    labels = ["model_name", "engine"]
    config = SimpleNamespace(ec_transfer_config=None)  # the base class only keeps it
    prom = ECCPUPromMetrics(
        config,  # type: ignore[arg-type]
        _metric_types(registry),
        labels,
        {0: ["m", "0"], 1: ["m", "1"]},
    )
    prom.observe({"hits": 3, "bytes_loaded": 4096, "region_entries": 5}, engine_idx=1)
    prom.observe({"hits": 2, "misses": 0}, engine_idx=1)
    value = registry.get_sample_value
    assert value("vllm:ec_cpu_hits_total", {"model_name": "m", "engine": "1"}) == 5
    assert value("vllm:ec_cpu_hits_total", {"model_name": "m", "engine": "0"}) == 0
    assert value("vllm:ec_cpu_bytes_loaded_total", {"model_name": "m", "engine": "1"}) == 4096
    assert value("vllm:ec_cpu_region_entries", {"model_name": "m", "engine": "1"}) == 5
    assert value("vllm:ec_cpu_misses_total", {"model_name": "m", "engine": "1"}) == 0
