"""ECCPUPromMetrics: the connector's Prometheus families.

Runs in vLLM's front end (the API server or the `LLM` process), which calls
the connector class's `build_prom_metrics` once and then `observe` with every
stats hand-over of every engine. The names and their meanings are in
`ec_core.stats`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ec_core import _vllm  # noqa: F401  (version gate before the vLLM import)

# isort: split

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics

from ec_core.stats import COUNTERS, GAUGES, LABELLED, PREFIX, parse_labelled_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class ECCPUPromMetrics(ECConnectorPromMetrics):
    """One Prometheus family per counter and gauge, one child per engine.

    Counters are named `vllm:ec_cpu_<name>` (exposed with `_total`), gauges
    `vllm:ec_cpu_<name>`; both carry vLLM's engine labels. The families of
    `LABELLED` carry their own labels as well (`rank_copies`: op, rank;
    `remote_fallbacks`: cause); their children appear as values are reported.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, help_text in COUNTERS.items():
            family = self._counter_cls(
                name=PREFIX + name, documentation=help_text, labelnames=labelnames
            )
            self._counters[name] = self._per_engine(family)
        gauge_cls: Any = self._gauge_cls  # typed as any metric class by vLLM
        for name, help_text in GAUGES.items():
            family = gauge_cls(
                name=PREFIX + name,
                documentation=help_text,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            self._gauges[name] = self._per_engine(family)
        self._labelled: dict[str, Any] = {
            family: self._counter_cls(
                name=PREFIX + family, documentation=help_text, labelnames=[*labelnames, *names]
            )
            for family, (names, help_text) in LABELLED.items()
        }

    def _per_engine(self, family: Any) -> dict[int, Any]:
        return {
            engine: family.labels(*values) for engine, values in self.per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value > 0:
                self._counters[name][engine_idx].inc(value)
            elif name in self._gauges:
                self._gauges[name][engine_idx].set(value)
            elif value > 0 and (parsed := parse_labelled_key(name)) is not None:
                family, values = parsed
                engine = self.per_engine_labelvalues[engine_idx]
                self._labelled[family].labels(*engine, *values).inc(value)
