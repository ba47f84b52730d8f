"""ec-core: the shared foundation of the EC CPU tier for vLLM.

Metadata exchanged between scheduler and workers, validated settings, the
shared host region and its layout, and the block allocator with its eviction
policies. Nothing here is device specific or scheduler specific.
"""

from ec_core.allocator import AllocatorError, BlockAllocator, Entry
from ec_core.layout import RegionLayout, create_ec_shared_region, open_region, region_layout
from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerMetadata
from ec_core.policy import POLICIES, EvictionPolicy, LRUPolicy
from ec_core.region import ECSharedRegion, RegionError
from ec_core.settings import ECCPUSettings
from ec_core.sizes import parse_byte_size

__all__ = [
    "POLICIES",
    "AllocatorError",
    "BlockAllocator",
    "ECCPUConnectorMetadata",
    "ECCPUSettings",
    "ECCPUWorkerMetadata",
    "ECSharedRegion",
    "Entry",
    "EvictionPolicy",
    "LRUPolicy",
    "RegionError",
    "RegionLayout",
    "create_ec_shared_region",
    "open_region",
    "parse_byte_size",
    "region_layout",
]
