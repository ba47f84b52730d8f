"""Drive vLLM's real v1 `Scheduler` in-process with this project's connector.

`real_scheduler` builds `vllm.v1.core.sched.scheduler.Scheduler` over a small KV
cache, with `ECCPUTierConnector` as its EC connector (its scheduler half follows
no reservation: no workers create the region). vLLM sizes its encoder budget
and encoder cache from the model's processor, which needs a tokenizer; the
figures are given here instead.

`SimulatedWorker` plays one rank: an encoder cache keyed by identifier and a
region whose blocks hold the identifier (and row count) of the item whose rows
were written there, and the key they were saved under; like the real worker, it
saves only an output of the shape the scheduler sent, and reads and writes the
encoder cache under the identifier the metadata names for a salted key. It
checks every gather of a step: an item missing from its encoder cache, or
holding another item's rows or another row count, is recorded in `errors`; so is an
item left in its encoder cache after a step that vLLM's encoder cache manager no longer
tracks (vLLM would never tell the worker to free it).
`run_step` is one engine step: `schedule`, the worker, `update_from_output`.

`AsyncSteps` drives vLLM's `AsyncScheduler` (`real_scheduler(...,
async_scheduling=True)`) the way `EngineCore.step_with_batch_queue` does with
async scheduling: a batch queue of depth 2, so step N+1 is scheduled, and the
worker runs it, before step N's output and the worker's report of step N reach
`update_from_output`.
"""

from __future__ import annotations

import random
import types
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched import scheduler as vllm_scheduler
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ECConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerReport
from ec_scheduler import ECCPUScheduler
from ec_scheduler.shell.connector import ECCPUTierConnector
from ectools.configs import make_vllm_config


def real_scheduler(
    model_dir: str | Path,
    region_dir: str | Path,
    *,
    encoder_budget: int = 32,
    encoder_cache: int = 32,
    kv_blocks: int = 64,
    block_size: int = 4,
    max_batched_tokens: int = 64,
    max_seqs: int = 4,
    policy: str = "fcfs",
    v2: bool = False,
    width: int = 128,
    region_bytes: int = 1 << 20,
    async_scheduling: bool = False,
    long_prefill: int = 0,
) -> vllm_scheduler.Scheduler:
    """vLLM's scheduler with `ECCPUTierConnector` (image width `width`, fp32).

    `v2` selects what the scheduler half assumes of the model runner (whether
    steps without tokens reach the workers); vLLM picks V1 on this CPU host.
    `async_scheduling` builds vLLM's `AsyncScheduler` (drive it with `AsyncSteps`);
    `long_prefill` is vLLM's `long_prefill_token_threshold` (0: none).
    """
    config = make_vllm_config(
        model_dir,
        extra={"ec_cpu_bytes": region_bytes, "ec_cpu_dir": str(region_dir)},
        widths={"image": width},
        max_num_batched_tokens=max_batched_tokens,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=True,
        max_model_len=512,
        scheduling_policy=policy,
        long_prefill_token_threshold=long_prefill,
        # A generating model (the config-only folder would resolve to a pooling
        # one): it samples a token per step, which async scheduling counts ahead.
        hf_overrides={"architectures": ["Blip2ForConditionalGeneration"]},
    )
    config.cache_config.num_gpu_blocks = kv_blocks
    config.scheduler_config.async_scheduling = async_scheduling
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=16, dtype=torch.float32
    )
    kv_config = KVCacheConfig(
        num_blocks=kv_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    budget = types.SimpleNamespace(
        encoder_compute_budget=encoder_budget,
        encoder_cache_size=encoder_cache,
        mm_max_toks_per_item={"image": encoder_budget},
    )

    def make_scheduler_half(_: ECCPUTierConnector, vllm_config: Any) -> ECCPUScheduler:
        half = ECCPUScheduler(vllm_config)
        half._empty_steps_reach_workers = v2
        return half

    with (
        mock.patch.object(vllm_scheduler, "MultiModalBudget", return_value=budget),
        mock.patch.object(ECCPUTierConnector, "_make_scheduler", make_scheduler_half),
    ):
        kind = AsyncScheduler if async_scheduling else vllm_scheduler.Scheduler
        return kind(config, kv_config, StructuredOutputManager(config), block_size=block_size)


def scheduler_half(scheduler: vllm_scheduler.Scheduler) -> ECCPUScheduler:
    connector = scheduler.ec_connector
    assert isinstance(connector, ECCPUTierConnector)
    return connector.scheduler


def mm_request(
    request_id: str,
    items: Sequence[tuple[str, int]],
    *,
    text: int = 4,
    gap: int = 2,
    max_tokens: int = 2,
    priority: int = 0,
    cache_salt: str | None = None,
) -> Request:
    """A request with `text` text tokens, then each `(identifier, embeds)` item
    followed by `gap` text tokens, then one more text token (and vLLM's
    per-tenant `cache_salt`, if given)."""
    features = []
    offset = text
    for identifier, embeds in items:
        features.append(
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(),  # the item carries its input
                modality="image",
                identifier=identifier,
                mm_position=PlaceholderRange(offset=offset, length=embeds),
                mm_hash=identifier,
            )
        )
        offset += embeds + gap
    return Request(
        request_id=request_id,
        prompt_token_ids=[1] * (offset + 1),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        mm_features=features,
        priority=priority,
        cache_salt=cache_salt,
    )


@dataclass
class _Copy:
    due: int
    meta_step: int
    tid: int = -1
    key: str = ""
    identifier: str = ""
    blocks: list[int] = field(default_factory=list)
    rows: int = 0


@dataclass
class SimulatedWorker:
    """One rank that encodes, loads, saves and gathers as the real one would.

    Copies land `0..max_delay` of its steps after they were asked for (drawn
    from `rng`); a save's rows reach the region only when it lands.
    """

    rng: random.Random = field(default_factory=lambda: random.Random(0))
    max_delay: int = 0
    cache: dict[str, tuple[str, int]] = field(default_factory=dict)
    """identifier -> (whose rows, how many)"""
    region: dict[int, tuple[str, int]] = field(default_factory=dict)
    """block -> (whose rows, how many rows that item has)"""
    region_keys: dict[int, str] = field(default_factory=dict)
    """block -> the key of the save that wrote it"""
    loaded: list[tuple[str, str]] = field(default_factory=list)
    """(key loaded, key of the save whose rows it found), per load"""
    errors: list[str] = field(default_factory=list)
    _copies: list[_Copy] = field(default_factory=list)
    _step: int = 0
    _runs: int = 0

    def run(self, output: SchedulerOutput, requests: dict[str, Request]) -> ECCPUWorkerReport:
        self._runs += 1
        self.drop_freed(output)
        meta = output.ec_connector_metadata
        report = ECCPUWorkerReport(group_size=1)
        if isinstance(meta, ECCPUConnectorMetadata):
            self._step = max(self._step, meta.step)
            for key, (tid, blocks, (rows, _)) in meta.loads.items():
                owners = {self.region.get(block, ("nothing", 0)) for block in blocks}
                owner, saved = owners.pop() if len(owners) == 1 else (f"a mix of {owners}", 0)
                identifier = meta.identifiers.get(key, key)
                self.cache[identifier] = (
                    owner if saved == rows else f"{owner} ({saved} rows)",
                    rows,
                )
                writers = {self.region_keys.get(block, "nothing") for block in blocks}
                self.loaded.append((key, writers.pop() if len(writers) == 1 else "a mix"))
                self._copies.append(_Copy(self._due(), meta.step, tid=tid))
            encoded = set()
            for request_id, indices in output.scheduled_encoder_inputs.items():
                for index in indices:
                    feature = requests[request_id].mm_features[index]
                    rows = feature.mm_position.get_num_embeds()
                    self.cache[feature.identifier] = (feature.identifier, rows)
                    encoded.add(feature.identifier)
            for key, blocks in meta.saves.items():
                rows = meta.save_shapes[key][0]
                identifier = meta.identifiers.get(key, key)
                if identifier in encoded and self.cache[identifier][1] == rows:
                    self._copies.append(
                        _Copy(
                            self._due(),
                            meta.step,
                            key=key,
                            identifier=identifier,
                            blocks=blocks,
                            rows=rows,
                        )
                    )
                else:  # the real worker reports a save whose output never came, or
                    # came in another shape, as failed
                    report.failed_saves.append((0, meta.step, key))
        self._check_gathers(output, requests)
        waiting = []
        for copy in self._copies:
            if copy.due > self._runs:
                waiting.append(copy)
            elif copy.key:
                for block in copy.blocks:
                    self.region[block] = (copy.identifier, copy.rows)
                    self.region_keys[block] = copy.key
                report.save_acks.append((0, copy.meta_step, copy.key))
            else:
                report.load_acks.append((0, copy.tid))
        self._copies = waiting
        settled = min((copy.meta_step for copy in waiting), default=self._step + 1) - 1
        report.progress.append((0, self._step, settled))
        return report

    def drop_freed(self, output: SchedulerOutput) -> None:
        """What the model runner does with every step, one without tokens included,
        before the connector loads: drop the items vLLM's encoder cache freed."""
        for key in output.free_encoder_mm_hashes:
            self.cache.pop(key, None)

    def check_tracked(self, tracked: Collection[str], step: int) -> None:
        """Record each item in the encoder cache that vLLM does not track (`tracked`:
        its encoder cache manager's items): nothing would ever free it."""
        for key in sorted(set(self.cache).difference(tracked)):
            self.errors.append(f"after step {step}, {key} stays in the encoder cache untracked")

    def _due(self) -> int:
        return self._runs + self.rng.randint(0, self.max_delay)

    def _check_gathers(self, output: SchedulerOutput, requests: dict[str, Request]) -> None:
        for request_id, count in output.num_scheduled_tokens.items():
            request = requests[request_id]
            end = request.num_computed_tokens  # schedule() has advanced it already
            start = end - count
            for feature in request.mm_features:
                position = feature.mm_position
                if not (position.offset < end and position.offset + position.length > start):
                    continue
                wanted = (feature.identifier, position.get_num_embeds())
                got = self.cache.get(feature.identifier)
                if got != wanted:
                    self.errors.append(
                        f"{request_id} gathers {wanted[0]} ({wanted[1]} rows) and finds "
                        f"{'nothing' if got is None else f'{got[0]} ({got[1]} rows)'}"
                    )


def run_step(
    scheduler: vllm_scheduler.Scheduler, worker: SimulatedWorker, *, v2: bool = False
) -> SchedulerOutput:
    """One engine step. On V1, a step without tokens does not reach the worker."""
    output = scheduler.schedule()
    scheduler.update_from_output(output, _execute(scheduler, worker, output, v2))
    return output


def _execute(
    scheduler: vllm_scheduler.Scheduler,
    worker: SimulatedWorker,
    output: SchedulerOutput,
    v2: bool,
) -> ModelRunnerOutput:
    """What the model runner returns for `output`, run right after it was scheduled:
    a token for each request whose tokens this step reach its end (async
    scheduling counts the tokens still in flight as output placeholders)."""
    requests = scheduler.requests
    report = None
    if v2 or output.total_num_scheduled_tokens > 0:
        report = worker.run(output, requests)
    else:
        worker.drop_freed(output)
    worker.check_tracked(scheduler.encoder_cache_manager.cached, scheduler.current_step)
    request_ids = list(output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=request_ids,
        req_id_to_index={rid: i for i, rid in enumerate(request_ids)},
        sampled_token_ids=[[] if requests[rid].is_prefill_chunk else [7] for rid in request_ids],
        ec_connector_output=(
            None if report is None else ECConnectorOutput(ec_connector_worker_meta=report)
        ),
    )


@dataclass
class AsyncSteps:
    """`EngineCore.step_with_batch_queue` over an `AsyncScheduler`, queue depth 2.

    Each `step` schedules a batch while the queue has room and runs it on the
    worker at once (as `execute_model` starts it); only when the queue is full,
    or nothing more can be scheduled, does the oldest batch's output, with the
    worker's report of that step, go to `update_from_output`.
    """

    scheduler: vllm_scheduler.Scheduler
    worker: SimulatedWorker
    v2: bool = False
    depth: int = 2
    _queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = field(default_factory=deque)

    def step(self) -> SchedulerOutput | None:
        """One call of `step_with_batch_queue`; returns the batch it scheduled, if any."""
        scheduler, scheduled = self.scheduler, None
        if scheduler.has_requests():
            scheduled = scheduler.schedule()
            self._queue.appendleft(
                (scheduled, _execute(scheduler, self.worker, scheduled, self.v2))
            )
            executed = scheduled.total_num_scheduled_tokens > 0
            if len(self._queue) < self.depth and (executed or scheduler.has_requests()):
                return scheduled
        elif not self._queue:
            return None
        output, result = self._queue.pop()
        scheduler.update_from_output(output, result)
        return scheduled

    @property
    def busy(self) -> bool:
        """Whether the engine loop would call `step` again."""
        return bool(self._queue) or self.scheduler.has_requests()
