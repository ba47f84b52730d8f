"""ec-core: the foundation of the EC CPU tier for vLLM.

Top-level modules serve every process (metadata exchanged between scheduler
and workers, settings, the region's geometry, the stats' names); the
subpackages are named for the process that runs them: `scheduler_process`
(block allocator, policies), `worker_process` (the common worker and the
device-independent backend machinery), `frontend_process` (Prometheus), and
`region` (the shared file: its names and locks for every process, its mapping
for workers). Nothing here is device specific or scheduler logic.

Names are imported on first use, so `import ec_core` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_core.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "AllocatorError": "ec_core.scheduler_process.allocator",
    "BlockAllocator": "ec_core.scheduler_process.allocator",
    "Entry": "ec_core.scheduler_process.allocator",
    "RegionLayout": "ec_core.layout",
    "create_ec_shared_region": "ec_core.region.opening",
    "open_region": "ec_core.region.opening",
    "region_layout": "ec_core.layout",
    "ECCPUConnectorMetadata": "ec_core.metadata",
    "ECCPUWorkerMetadata": "ec_core.metadata",
    "ECCPUWorkerReport": "ec_core.metadata",
    "POLICIES": "ec_core.scheduler_process.policy",
    "EvictionPolicy": "ec_core.scheduler_process.policy",
    "LRUPolicy": "ec_core.scheduler_process.policy_lru",
    "ECSharedRegion": "ec_core.region.mapping",
    "RegionError": "ec_core.region.files",
    "ECCPUSettings": "ec_core.settings",
    "parse_byte_size": "ec_core.sizes",
    "TransferDirection": "ec_core.worker_process.transfer",
    "ECCPUWorker": "ec_core.worker_process.worker",
    "ECCPULoadError": "ec_core.worker_process.entries",
    "RankInfo": "ec_core.worker_process.ranks",
}

__all__ = [
    "POLICIES",
    "AllocatorError",
    "BlockAllocator",
    "ECCPUConnectorMetadata",
    "ECCPULoadError",
    "ECCPUSettings",
    "ECCPUWorker",
    "ECCPUWorkerMetadata",
    "ECCPUWorkerReport",
    "ECSharedRegion",
    "Entry",
    "EvictionPolicy",
    "LRUPolicy",
    "RankInfo",
    "RegionError",
    "RegionLayout",
    "TransferDirection",
    "create_ec_shared_region",
    "open_region",
    "parse_byte_size",
    "region_layout",
]

if TYPE_CHECKING:
    from ec_core.layout import RegionLayout, region_layout
    from ec_core.metadata import ECCPUConnectorMetadata, ECCPUWorkerMetadata, ECCPUWorkerReport
    from ec_core.region.files import RegionError
    from ec_core.region.mapping import ECSharedRegion
    from ec_core.region.opening import create_ec_shared_region, open_region
    from ec_core.scheduler_process.allocator import AllocatorError, BlockAllocator, Entry
    from ec_core.scheduler_process.policy import POLICIES, EvictionPolicy
    from ec_core.scheduler_process.policy_lru import LRUPolicy
    from ec_core.settings import ECCPUSettings
    from ec_core.sizes import parse_byte_size
    from ec_core.worker_process.entries import ECCPULoadError
    from ec_core.worker_process.ranks import RankInfo
    from ec_core.worker_process.transfer import TransferDirection
    from ec_core.worker_process.worker import ECCPUWorker


__getattr__ = lazy_exports(__name__, _EXPORTS)
