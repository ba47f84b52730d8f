"""ec-core: the shared foundation of the EC CPU tier for vLLM.

Metadata exchanged between scheduler and workers, validated settings, the
shared host region and its layout, the block allocator with its eviction
policies, the common worker and the role-routed connector shell. Nothing here
is device specific or scheduler specific.

Names are imported on first use, so `import ec_core` (and the backends'
plugin entry points that import it) stays cheap until something is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_core.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "AllocatorError": "ec_core.allocator",
    "BlockAllocator": "ec_core.allocator",
    "Entry": "ec_core.allocator",
    "ECCPUConnectorBase": "ec_core.connector",
    "RegionLayout": "ec_core.layout",
    "create_ec_shared_region": "ec_core.layout",
    "open_region": "ec_core.layout",
    "region_layout": "ec_core.layout",
    "ECCPUConnectorMetadata": "ec_core.metadata",
    "ECCPUWorkerMetadata": "ec_core.metadata",
    "ECCPUWorkerReport": "ec_core.metadata",
    "POLICIES": "ec_core.policy",
    "EvictionPolicy": "ec_core.policy",
    "LRUPolicy": "ec_core.policy",
    "ECSharedRegion": "ec_core.region",
    "RegionError": "ec_core.region",
    "ECCPUSettings": "ec_core.settings",
    "parse_byte_size": "ec_core.sizes",
    "TransferDirection": "ec_core.transfer",
    "ECCPUWorker": "ec_core.worker",
}

__all__ = [
    "POLICIES",
    "AllocatorError",
    "BlockAllocator",
    "ECCPUConnectorBase",
    "ECCPUConnectorMetadata",
    "ECCPUSettings",
    "ECCPUWorker",
    "ECCPUWorkerMetadata",
    "ECCPUWorkerReport",
    "ECSharedRegion",
    "Entry",
    "EvictionPolicy",
    "LRUPolicy",
    "RegionError",
    "RegionLayout",
    "TransferDirection",
    "create_ec_shared_region",
    "open_region",
    "parse_byte_size",
    "region_layout",
]

if TYPE_CHECKING:
    from ec_core.allocator import AllocatorError, BlockAllocator, Entry
    from ec_core.connector import ECCPUConnectorBase
    from ec_core.layout import RegionLayout, create_ec_shared_region, open_region, region_layout
    from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerMetadata, ECCPUWorkerReport
    from ec_core.policy import POLICIES, EvictionPolicy, LRUPolicy
    from ec_core.region import ECSharedRegion, RegionError
    from ec_core.settings import ECCPUSettings
    from ec_core.sizes import parse_byte_size
    from ec_core.transfer import TransferDirection
    from ec_core.worker import ECCPUWorker


__getattr__ = lazy_exports(__name__, _EXPORTS)
