"""Connector statistics through vLLM's hooks: the metric names and the interval stats.

The scheduler half hands vLLM an `ECCPUConnectorStats` after every step in
which something happened (`get_ec_connector_stats`): counter *deltas* since the
previous hand-over plus the current *gauges*. Worker-side figures (bytes moved,
copy time) reach the scheduler inside the workers' reports, because vLLM's V1
runner never asks the worker connector for stats; every rank's figures are
summed. vLLM ships the stats' `data` to its front end, where
`build_ec_connector_stats` rebuilds them for the periodic "EC Transfer metrics"
log line and `build_prom_metrics` exports them as Prometheus families
(`ec_core.frontend_process.prometheus`).

Runs in the scheduler process (building stats) and in vLLM's front end
(folding and reducing them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ec_core import _vllm  # noqa: F401  (version gate before the vLLM import)

# isort: split

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

PREFIX = "vllm:ec_cpu_"

COUNTERS: dict[str, str] = {
    "lookups": "Items scheduled that vLLM's own encoder cache lacked (each once, however long "
    "its request waited)",
    "hits": "Of those, loaded from the CPU region (encoder runs avoided)",
    "misses": "Of those, encoded (the CPU region could not answer)",
    "saves": "Encoder outputs written to the CPU region",
    "loads": "Encoder outputs loaded back from the CPU region",
    "saves_failed": "Saves a worker could not perform",
    "save_fallbacks": "Saves copied synchronously because their batched copy failed",
    "load_fallbacks": "Loads copied synchronously because their batched copy or buffer failed",
    "saves_not_admitted": "Saves the admission rule turned down",
    "saves_skipped": "Saves skipped: region full of held entries, oversized or empty items, "
    "unmeasured modalities",
    "evictions": "Entries evicted from the CPU region",
    "bytes_saved": "Bytes of encoder output written to the CPU region (all ranks)",
    "bytes_loaded": "Bytes of encoder output loaded from the CPU region (all ranks)",
    "save_copy_seconds": "Time copies into the CPU region took (all ranks)",
    "load_copy_seconds": "Time copies out of the CPU region took (all ranks)",
    "reclaimed": "Saves and loads still unreported past the report bound (blocks held "
    "until they settle)",
    "reports_lost": "Copies that settled without their own report (the ranks moved past them)",
    "stale_dropped": "Entries dropped because their shape no longer matched the request",
    "remote_lookups": "Items this engine asked other engines for (its region missed them)",
    "remote_hits": "Items fetched from another engine into this engine's region",
    "bytes_fetched": "Bytes of encoder output fetched from other engines",
    "fetch_seconds": "Time fetches from other engines took",
    "peer_lookups_served": "Items this engine leased to other engines",
    "peer_lookups_not_ready": "Items other engines asked for while this engine was still "
    "saving them",
    "peer_bytes_served": "Bytes of encoder output other engines read from this engine",
    "peer_requests_denied": "Peer messages dropped: not signed with the shared secret, stale "
    "or malformed",
    "policy_mode_changes": "Times the eviction policy switched between evicting as plain LRU "
    "and by request count (wtinylfu's guard)",
}

GAUGES: dict[str, str] = {
    "region_blocks": "Blocks in the CPU region (one embedding row each)",
    "region_used_blocks": "Blocks of the CPU region holding entries",
    "region_entries": "Entries in the CPU region",
    "region_held_entries": "Entries being written or loaded (not evictable)",
    "policy_lru_mode": "Engines whose eviction policy evicts as plain LRU now: always with "
    "lru, never with s3lfu; wtinylfu from its start until its guard finds evicting by "
    "request count would serve more, and again whenever it finds plain LRU would",
}

WORKER_COUNTERS = ("bytes_saved", "bytes_loaded", "save_copy_seconds", "load_copy_seconds")
"""The counters workers report (in ECCPUWorkerReport.stats)."""

RANK_COPY_OPS = ("save", "load", "save_fallback", "load_fallback")

LABELLED: dict[str, tuple[tuple[str, ...], str]] = {
    "rank_copies": (
        ("op", "rank"),
        "Copies each rank performed, by op: save, load, and the saves and loads it had to "
        "copy synchronously because their batched copy failed (save_fallback, load_fallback)",
    ),
    "remote_fallbacks": (
        ("cause",),
        "Items not fetched from another engine (so encoded here), by cause",
    ),
}
"""Counter families with labels of their own: name -> (label names, help)."""


def labelled_key(family: str, *values: object) -> str:
    """The stats key of one child of a labelled family, e.g. `rank_copies:load_fallback:1`."""
    return ":".join((family, *(str(v) for v in values)))


def parse_labelled_key(name: str) -> tuple[str, tuple[str, ...]] | None:
    """`(family, label values)` of a `labelled_key`, or None for any other name."""
    family, _, rest = name.partition(":")
    spec = LABELLED.get(family)
    if spec is None or not rest:
        return None
    values = tuple(rest.split(":"))
    if len(values) != len(spec[0]) or not all(values):
        return None
    if family == "rank_copies" and (values[0] not in RANK_COPY_OPS or not values[1].isdigit()):
        return None
    return family, values


ENGINE = "engine"
"""Stats key naming the engine (its data-parallel rank) whose scheduler built the stats.
Neither a counter nor a gauge: it tells `aggregate` whose gauges it is given."""


def is_counter(name: str) -> bool:
    """Whether `name` is summed over intervals (a counter) rather than replaced (a gauge)."""
    return name in COUNTERS or parse_labelled_key(name) is not None


@dataclass
class ECCPUConnectorStats(ECConnectorStats):
    """Counter deltas and gauge values in one flat, serialisable dict.

    `aggregate` sums counters and keeps each engine's newest gauges; once
    stats of several engines have met (vLLM's aggregated log line of
    data-parallel engines, `--aggregate-engine-logging`), each gauge is the
    sum over those engines, like the counters. Only engines that handed
    stats over in the interval are in that sum (an engine hands over only
    when a counter moved; vLLM starts each interval afresh). `reduce` returns
    the figures for the log line, with the hit rate of the interval.
    """

    _engine_gauges: dict[object, dict[str, float]] = field(
        default_factory=dict, repr=False, compare=False
    )
    """Accumulator state (front end only, never shipped): each engine's newest gauges."""

    def reset(self) -> None:
        self.data = {}
        self._engine_gauges = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        engines = self._engine_gauges
        if not engines and self.data:
            engines[self.data.get(ENGINE)] = _gauges_of(self.data)
        for name, value in other.data.items():
            if is_counter(name):
                self.data[name] = self.data.get(name, 0) + value
            else:
                self.data[name] = value
        theirs = other._engine_gauges if isinstance(other, ECCPUConnectorStats) else {}
        for engine, gauges in (theirs or {other.data.get(ENGINE): _gauges_of(other.data)}).items():
            engines.setdefault(engine, {}).update(gauges)
        if len(engines) > 1:
            # Each engine has a region of its own: the newest value of one engine
            # is not the figure of all of them.
            for name in GAUGES:
                values = [gauges[name] for gauges in engines.values() if name in gauges]
                if values:
                    self.data[name] = sum(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        figures: dict[str, int | float] = {
            name: self.data[name] for name in (*COUNTERS, *GAUGES) if name in self.data
        }
        for name in sorted(self.data):
            if parse_labelled_key(name) is not None:
                figures[name] = self.data[name]
        lookups = self.data.get("lookups", 0)
        if lookups:
            figures["hit_rate"] = round(self.data.get("hits", 0) / lookups, 4)
        return figures

    def is_empty(self) -> bool:
        return not any(value for name, value in self.data.items() if is_counter(name))


def _gauges_of(data: dict[str, float]) -> dict[str, float]:
    return {name: data[name] for name in GAUGES if name in data}


__all__ = [
    "COUNTERS",
    "ENGINE",
    "GAUGES",
    "LABELLED",
    "RANK_COPY_OPS",
    "WORKER_COUNTERS",
    "ECCPUConnectorStats",
    "is_counter",
    "labelled_key",
    "parse_labelled_key",
]
