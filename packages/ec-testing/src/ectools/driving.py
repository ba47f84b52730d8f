"""Drive a scheduler half the way vLLM's scheduler does, with real vLLM objects.

`make_request` builds a real `vllm.v1.request.Request` with real multimodal
feature specs; `StepDriver` replays vLLM's per-step call order against an
`ECCPUScheduler` (lookups, then allocation — computed items first, loads
second — then the metadata), and `SimulatedRanks` plays the workers: it turns
the step's metadata into the reports the real workers would send.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request

from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport


@dataclass(frozen=True)
class Item:
    """One multimodal item of a request."""

    identifier: str
    embeds: int = 8
    modality: str = "image"


def make_request(
    request_id: str,
    items: Sequence[Item],
    *,
    text_tokens: int = 4,
    cache_salt: str | None = None,
) -> Request:
    """A real vLLM Request whose prompt holds `items` after some text tokens (with
    vLLM's per-tenant `cache_salt`, if given)."""
    features = []
    offset = text_tokens
    for item in items:
        features.append(
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(),  # the item carries its input
                modality=item.modality,
                identifier=item.identifier,
                mm_position=PlaceholderRange(offset=offset, length=item.embeds),
                mm_hash=item.identifier.split(":")[-1],
            )
        )
        offset += item.embeds
    prompt = [1] * (offset + 1)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=features,
        cache_salt=cache_salt,
    )


def scheduler_output(num_tokens: int = 1) -> SchedulerOutput:
    """A SchedulerOutput for a step that scheduled `num_tokens` tokens."""
    output = SchedulerOutput.make_empty()
    output.total_num_scheduled_tokens = num_tokens
    return output


def connector_output(report: ECCPUWorkerReport | Any | None) -> ECConnectorOutput:
    return ECConnectorOutput(ec_connector_worker_meta=report)


def save_meta(
    sources: Mapping[str, tuple[list[int], torch.Tensor]], *, step: int = 0
) -> ECCPUConnectorMetadata:
    """Metadata asking for a save of each `key: (block_ids, 2-D tensor)`, allocated
    for the tensor's `(rows, cols)`: what the scheduler would send for them."""
    return ECCPUConnectorMetadata(
        saves={key: blocks for key, (blocks, _) in sources.items()},
        save_shapes={key: (int(t.shape[0]), int(t.shape[1])) for key, (_, t) in sources.items()},
        step=step,
    )


@dataclass
class StepResult:
    """What one driven step decided."""

    meta: ECCPUConnectorMetadata
    looked_up: dict[str, bool] = field(default_factory=dict)


class StepDriver:
    """Calls a scheduler half in vLLM's order for a batch of requests."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, requests: Iterable[Request], *, skip_alloc: Iterable[str] = ()) -> StepResult:
        """Schedule every item of every request in one step.

        For each request: `ensure_cache_available`, `has_cache_item` per item,
        then `update_state_after_alloc` for the computed items followed by the
        looked-up ones (vLLM's order). Items already seen in this step are
        duplicates and are neither looked up nor allocated, as in vLLM.
        Requests listed in `skip_alloc` are looked up but then not scheduled.
        """
        skipped = set(skip_alloc)
        looked_up: dict[str, bool] = {}
        scheduled: set[str] = set()
        for request in requests:
            self.scheduler.ensure_cache_available(request, 0)
            compute: list[int] = []
            loads: list[int] = []
            for index, feature in enumerate(request.mm_features):
                if feature.identifier in scheduled:
                    continue
                scheduled.add(feature.identifier)
                hit = self.scheduler.has_cache_item(feature.identifier)
                looked_up[feature.identifier] = hit
                (loads if hit else compute).append(index)
            if request.request_id in skipped:
                continue
            for index in compute + loads:
                self.scheduler.update_state_after_alloc(request, index)
        meta = self.scheduler.build_connector_meta(scheduler_output())
        return StepResult(meta=meta, looked_up=looked_up)


class SimulatedRanks:
    """Workers of `ranks` ranks: rank 0 performs saves, every rank performs loads.

    Their copies are instantaneous; `report` says what the real workers would
    send after performing a step's metadata.
    """

    def __init__(self, ranks: int = 1) -> None:
        self.ranks = ranks

    def report(
        self,
        meta: ECCPUConnectorMetadata,
        *,
        ranks: Iterable[int] | None = None,
        fail_saves: Iterable[str] = (),
        settled: int | None = None,
        waiting: Iterable[int] = (),
    ) -> ECCPUWorkerReport:
        """The aggregated report of `ranks` (default: all) for `meta`.

        Each reporting rank says it has settled through `settled` (default:
        `meta.step`, i.e. it ran every earlier step's copies too). Ranks in
        `waiting` send an empty report that has settled only up to the step
        before `meta`'s: alive, still busy with it.
        """
        failed_saves = set(fail_saves)
        through = meta.step if settled is None else settled
        reports = []
        for rank in range(self.ranks) if ranks is None else ranks:
            report = ECCPUWorkerReport(progress=[(rank, meta.step, through)], group_size=self.ranks)
            if rank == 0:
                for key in meta.saves:
                    if key in failed_saves:
                        report.failed_saves.append((rank, meta.step, key))
                    else:
                        report.completed_saves.append(key)
                        report.save_acks.append((rank, meta.step, key))
            for tid, _, _ in meta.loads.values():
                report.completed_loads.append(tid)
                report.load_acks.append((rank, tid))
            reports.append(report)
        reports.extend(
            ECCPUWorkerReport(
                progress=[(rank, meta.step, min(through, meta.step - 1))], group_size=self.ranks
            )
            for rank in waiting
        )
        head = reports[0]
        for other in reports[1:]:
            head.aggregate(other)
        return head
