"""The per-step payloads exchanged between the scheduler and the workers.

Both are plain dataclasses of dicts, lists, ints and tuples: vLLM serialises
the scheduler's object inside `SchedulerOutput` and the workers' objects inside
`ModelRunnerOutput`, so nothing here may hold a tensor or a handle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ec_core import _vllm  # noqa: F401  (version gate before the vLLM import)

# isort: split

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)


@dataclass
class ECCPUConnectorMetadata(ECConnectorMetadata):
    """What the workers must copy in one engine step (scheduler → workers).

    `saves` maps an mm_hash to the region block ids allocated for it this
    step: the worker copies `encoder_cache[mm_hash]` into those blocks, in
    order. `loads` maps an mm_hash to `(transfer_id, block_ids, (rows,
    cols))`: the worker rebuilds `encoder_cache[mm_hash]` with that shape from
    those blocks and reports `transfer_id` once its copy has landed. A
    transfer id is minted per dispatch, so a late report of an earlier load of
    the same mm_hash can never be mistaken for a later one.
    """

    saves: dict[str, list[int]] = field(default_factory=dict)
    loads: dict[str, tuple[int, list[int], tuple[int, int]]] = field(default_factory=dict)


@dataclass
class ECCPUWorkerMetadata(ECConnectorWorkerMetadata):
    """The copies a worker finished (workers → scheduler).

    Saves are reported by mm_hash (one rank writes each entry); loads by
    transfer id (every rank loads). vLLM folds all ranks' objects with
    `aggregate`, which concatenates, so a transfer id appears once per rank
    that finished it and the scheduler can count ranks off the list.
    """

    completed_saves: list[str] = field(default_factory=list)
    completed_loads: list[int] = field(default_factory=list)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        """Append `other`'s reports to this object's and return this object.

        Raises TypeError when `other` is not an ECCPUWorkerMetadata: folding a
        foreign connector's report into ours would silently lose it.
        """
        if not isinstance(other, ECCPUWorkerMetadata):
            raise TypeError(
                "ECCPUWorkerMetadata can only aggregate another ECCPUWorkerMetadata, "
                f"got {type(other).__module__}.{type(other).__qualname__}"
            )
        self.completed_saves.extend(other.completed_saves)
        self.completed_loads.extend(other.completed_loads)
        return self


@dataclass
class ECCPUWorkerReport(ECCPUWorkerMetadata):
    """What this project's workers send: the seed's report plus who sent it.

    The seed fields keep their meaning (and stay correct for any consumer of
    the seed type). The extra fields let the scheduler count ranks exactly:

    * `reporters`: the rank of every worker folded into this report, once
      per worker. A worker sends a report every step it runs the connector,
      even an empty one, so one aggregated report names every participating
      rank (vLLM's multiprocess executor folds all ranks; single-output
      executors deliver one rank).
    * `load_acks`: `(rank, transfer_id)` per finished load, so a repeated
      report from one rank is never counted as another rank's.
    * `failed_saves` / `failed_loads`: copies a worker could not perform; the
      scheduler drops a failed save's entry and releases a failed load's pin.
    * `stats`: figures the worker measured (bytes copied, copy time), summed
      over ranks — vLLM's V1 runner never asks workers for stats, so they
      travel here and the scheduler half publishes them.
    """

    reporters: list[int] = field(default_factory=list)
    load_acks: list[tuple[int, int]] = field(default_factory=list)
    failed_saves: list[str] = field(default_factory=list)
    failed_loads: list[tuple[int, int]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        """Concatenate every list of `other` onto this report; return self.

        A plain ECCPUWorkerMetadata contributes its seed lists only; any other
        type raises TypeError (see the base class).
        """
        super().aggregate(other)
        if isinstance(other, ECCPUWorkerReport):
            self.reporters.extend(other.reporters)
            self.load_acks.extend(other.load_acks)
            self.failed_saves.extend(other.failed_saves)
            self.failed_loads.extend(other.failed_loads)
            for name, value in other.stats.items():
                self.stats[name] = self.stats.get(name, 0.0) + value
        return self
