"""The per-step payloads exchanged between the scheduler and the workers.

Both are plain dataclasses of dicts, lists, ints, strings and tuples: vLLM
serialises the scheduler's object inside `SchedulerOutput` and the workers'
objects inside `ModelRunnerOutput`, so nothing here may hold a tensor or a
handle.

`ECCPUConnectorMetadata` and `ECCPUWorkerMetadata` are the two dataclasses of
vLLM's in-tree CPU connector design (same names, same first fields), so code
written against that design reads them as it expects; this project's workers
send the richer `ECCPUWorkerReport`.
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

    `step` numbers the metadata objects one scheduler builds (1, 2, ...):
    workers say how far their copies have settled in terms of it. `save_shapes`
    holds the `(rows, cols)` each save was allocated for; a worker saves only a
    tensor of exactly that shape and of the region's dtype. `runs` holds, per
    mm_hash of `saves` and `loads`, the runs of consecutive blocks its block
    ids make, `((first, count), ...)` in the ids' order: the copy descriptors,
    without a pass over the ids (a worker checks them against the ids' ends
    and computes them itself where a key has none).

    The keys of `saves` and `loads` are the tier's keys: vLLM's identifier
    (mm_hash) itself, or, for an item of a request with a `cache_salt`, the
    identifier wrapped with the salt's digest (`ec_scheduler.tenancy`).
    `identifiers` maps each key that is not vLLM's identifier to the identifier
    vLLM's encoder cache holds it under: a worker reads and writes
    `encoder_cache[identifiers.get(key, key)]`, and reports by key. It is
    empty on a step without salted keys.
    """

    saves: dict[str, list[int]] = field(default_factory=dict)
    loads: dict[str, tuple[int, list[int], tuple[int, int]]] = field(default_factory=dict)
    step: int = 0
    save_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    runs: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    identifiers: dict[str, str] = field(default_factory=dict)


@dataclass
class ECCPUWorkerMetadata(ECConnectorWorkerMetadata):
    """The copies a worker finished (workers → scheduler).

    Saves are reported by mm_hash (one rank writes each entry); loads by
    transfer id (every rank loads). vLLM folds all ranks' objects with
    `aggregate`, which concatenates, so a transfer id appears once per rank
    that finished it.
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
    """What this project's workers send each step: the two lists above, plus
    who sent it and how far each sender has got.

    * `progress`: `(rank, step, settled)` once per worker folded in: the last
      metadata step the rank ran, and the step up to which its copies have
      settled: every copy it was handed in steps `<= settled` has landed, or
      was reported failed, and none of them can read or write region memory
      any more. A worker sends a report every step it runs the connector, even
      an empty one.
    * `group_size`: how many ranks run this engine's connector copies (the
      tensor x context parallel ranks of the first pipeline stage); the
      scheduler trusts `progress` only once it has heard from that many.
    * `save_acks`: `(rank, step, mm_hash)` per save that landed; `step` is
      the metadata step that asked for it, so a late report of an earlier save
      of the same mm_hash is never taken for a later one.
    * `failed_saves`: `(rank, step, mm_hash)` per save the worker did not
      perform (a source of the wrong shape, or a copy that failed).
    * `load_acks`: `(rank, transfer_id)` per load that landed.
    * `fallbacks`: `(rank, "save" | "load")` per entry whose batched copy
      failed and that was copied synchronously instead.
    * `stats`: figures the worker measured (bytes copied, copy time), summed
      over ranks by `aggregate` (vLLM's V1 runner never asks workers for
      stats, so they travel here).

    The inherited `completed_saves` / `completed_loads` are filled as well;
    `group_size` aggregates as the largest.
    """

    progress: list[tuple[int, int, int]] = field(default_factory=list)
    group_size: int = 1
    save_acks: list[tuple[int, int, str]] = field(default_factory=list)
    failed_saves: list[tuple[int, int, str]] = field(default_factory=list)
    load_acks: list[tuple[int, int]] = field(default_factory=list)
    fallbacks: list[tuple[int, str]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        """Concatenate every list of `other` onto this report and sum its stats.

        Returns self. A plain ECCPUWorkerMetadata contributes its two lists
        only; any other type raises TypeError (see the base class).
        """
        super().aggregate(other)
        if isinstance(other, ECCPUWorkerReport):
            self.progress.extend(other.progress)
            self.group_size = max(self.group_size, other.group_size)
            self.save_acks.extend(other.save_acks)
            self.failed_saves.extend(other.failed_saves)
            self.load_acks.extend(other.load_acks)
            self.fallbacks.extend(other.fallbacks)
            for name, value in other.stats.items():
                self.stats[name] = self.stats.get(name, 0.0) + value
        return self
