"""Stats objects and Prometheus families of the connector."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ec_core.frontend_process.prometheus import ECCPUPromMetrics
from ec_core.stats import COUNTERS, GAUGES, ECCPUConnectorStats, labelled_key, parse_labelled_key


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


def test_per_rank_copy_counts_are_counters_and_reach_the_log_line() -> None:
    first = ECCPUConnectorStats(data={"rank_copies:load_fallback:1": 2, "region_entries": 3})
    second = ECCPUConnectorStats(data={"rank_copies:load_fallback:1": 1, "load_fallbacks": 1})
    first.aggregate(second)
    assert first.data["rank_copies:load_fallback:1"] == 3
    assert not first.is_empty()
    assert first.reduce()["rank_copies:load_fallback:1"] == 3
    assert ECCPUConnectorStats(data={"rank_copies:load:0": 0}).is_empty()
    key = labelled_key("rank_copies", "save_fallback", 4)
    assert parse_labelled_key(key) == ("rank_copies", ("save_fallback", "4"))
    assert parse_labelled_key("rank_copies:bogus:1") is None
    assert parse_labelled_key("remote_fallbacks:timeout") == ("remote_fallbacks", ("timeout",))
    assert parse_labelled_key("remote_fallbacks:") is None
    assert parse_labelled_key("hits") is None


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
    prom.observe({"hits": 2, "misses": 0, "engine": 1}, engine_idx=1)  # `engine` is no metric
    value = registry.get_sample_value
    assert value("vllm:ec_cpu_hits_total", {"model_name": "m", "engine": "1"}) == 5
    assert value("vllm:ec_cpu_hits_total", {"model_name": "m", "engine": "0"}) == 0
    assert value("vllm:ec_cpu_bytes_loaded_total", {"model_name": "m", "engine": "1"}) == 4096
    assert value("vllm:ec_cpu_region_entries", {"model_name": "m", "engine": "1"}) == 5
    assert value("vllm:ec_cpu_misses_total", {"model_name": "m", "engine": "1"}) == 0
    prom.observe({"rank_copies:load_fallback:1": 2, "load_fallbacks": 2}, engine_idx=0)
    prom.observe({"rank_copies:load_fallback:1": 1, "rank_copies:load:0": 4}, engine_idx=0)
    per_rank = {"model_name": "m", "engine": "0", "rank": "1", "op": "load_fallback"}
    assert value("vllm:ec_cpu_rank_copies_total", per_rank) == 3
    assert value("vllm:ec_cpu_rank_copies_total", {**per_rank, "rank": "0", "op": "load"}) == 4
    assert value("vllm:ec_cpu_load_fallbacks_total", {"model_name": "m", "engine": "0"}) == 2
    prom.observe({"remote_fallbacks:timeout": 3}, engine_idx=1)
    cause = {"model_name": "m", "engine": "1", "cause": "timeout"}
    assert value("vllm:ec_cpu_remote_fallbacks_total", cause) == 3


def test_stats_of_several_engines_sum_each_engines_newest_gauges() -> None:
    """vLLM's aggregated log line (`--aggregate-engine-logging`) folds every
    data-parallel engine's stats into one accumulator: each engine has a region of
    its own, so a gauge is the sum of each engine's newest value, not the value of
    whichever engine reported last."""
    full = {"engine": 0, "lookups": 1, "region_blocks": 100, "region_used_blocks": 90}
    empty = {"engine": 1, "lookups": 1, "region_blocks": 100, "region_used_blocks": 10}
    later = {"engine": 0, "hits": 1, "region_blocks": 100, "region_used_blocks": 95}
    accumulator = ECCPUConnectorStats(data=dict(full))
    accumulator.aggregate(ECCPUConnectorStats(data=dict(empty)))
    figures = accumulator.reduce()
    assert figures["region_blocks"] == 200
    assert figures["region_used_blocks"] == 100
    assert figures["lookups"] == 2
    accumulator.aggregate(ECCPUConnectorStats(data=dict(later)))
    figures = accumulator.reduce()
    assert figures["region_used_blocks"] == 105, "engine 0's newest value, plus engine 1's"
    assert figures["hit_rate"] == 0.5
    assert "engine" not in figures
    # One engine alone: its newest gauges, as before.
    alone = ECCPUConnectorStats(data=dict(full))
    alone.aggregate(ECCPUConnectorStats(data=dict(later)))
    assert alone.reduce()["region_used_blocks"] == 95
    alone.reset()
    alone.aggregate(ECCPUConnectorStats(data=dict(empty)))
    assert alone.reduce()["region_used_blocks"] == 10, "reset forgets the engines too"
