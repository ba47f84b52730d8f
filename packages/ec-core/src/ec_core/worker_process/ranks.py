"""Where a worker sits among the engine's ranks (read from vLLM's process groups).

Runs in worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ec_core._vllm import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this worker sits: its global rank, whether it writes saves, and how
    many ranks (itself included) run this engine's connector copies."""

    rank: int
    is_save_rank: bool
    group_size: int = 1


def detect_rank_info() -> RankInfo:
    """Read the rank from vLLM's initialised process groups.

    Only one rank writes saves (tensor-parallel rank 0 of prefill-context
    rank 0 of the first pipeline stage: every such rank holds the same encoder
    output); every rank loads. An encode-only engine on vLLM's V1 runner runs the
    encoder and the connector on every pipeline stage: without the stage in the
    rule, each stage's rank 0 would write the same blocks, and one stage's failed
    save would free blocks another stage was still writing.
    """
    from vllm.distributed import parallel_state as ps

    try:
        rank = ps.get_world_group().rank
        tp_rank = ps.get_tensor_model_parallel_rank()
        tp_size = ps.get_tensor_model_parallel_world_size()
        pcp = ps.get_pcp_group() if hasattr(ps, "get_pcp_group") else None
        pcp_rank = pcp.rank_in_group if pcp is not None else 0
        pcp_size = pcp.world_size if pcp is not None else 1
        pp = ps.get_pp_group() if hasattr(ps, "get_pp_group") else None
        pp_rank = pp.rank_in_group if pp is not None else 0
    except (AssertionError, AttributeError, RuntimeError) as exc:
        logger.warning(
            "EC CPU tier: vLLM's process groups are not initialised (%s); assuming a "
            "single rank that saves and loads",
            exc,
        )
        return RankInfo(rank=0, is_save_rank=True)
    # The connector runs on the first pipeline stage: its tensor x context
    # parallel ranks each report every step.
    return RankInfo(
        rank=int(rank),
        is_save_rank=tp_rank == 0 and pcp_rank == 0 and pp_rank == 0,
        group_size=int(tp_size) * int(pcp_size),
    )
