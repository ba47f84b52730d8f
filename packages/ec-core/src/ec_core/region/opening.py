"""A region described by a `RegionLayout`, created or joined, and mapped.

Runs where the region is mapped: every worker process, and the scheduler
process of an engine with cross-engine peers (the NIXL source registers the
region with its agent). `ec_core.layout` holds the geometry alone, so the
scheduler reads it without loading the mapping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_core.layout import RegionLayout, region_layout
from ec_core.region.mapping import ECSharedRegion

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def open_region(layout: RegionLayout, *, background_reserve: bool = False) -> ECSharedRegion:
    """Create or join the region `layout` describes.

    `background_reserve` asks for the background reservation (see
    `ECSharedRegion`); it is ignored, and every page reserved before this
    returns, when cross-engine peers are configured, since NIXL registers
    the whole region with the engine's agent.
    """
    return ECSharedRegion(
        layout.engine_id,
        layout.num_blocks,
        layout.block_size_bytes,
        directory=layout.settings.region_dir,
        open_timeout_s=layout.settings.open_timeout_s,
        owner=layout.owner,
        background_reserve=background_reserve and layout.settings.peers is None,
    )


def create_ec_shared_region(vllm_config: VllmConfig) -> ECSharedRegion:
    """Build the engine's shared region from `vllm_config` (the factory of vLLM's in-tree design).

    Every process of one engine computes the same identity and geometry, so
    the first caller creates the file and the others join it.
    """
    return open_region(region_layout(vllm_config))
