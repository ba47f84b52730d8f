"""ec-transfer-nixl: producers serve their entries to consumer engines over NIXL.

`create_remote_source` is what the `ec_cpu_tier.transports` entry point
announces; the scheduler calls it only when a cross-engine key is configured,
so NIXL, ZMQ and msgspec are imported only then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from ec_core.layout import RegionLayout
    from ec_scheduler.remote import LocalEntries, RemoteSource


def create_remote_source(
    vllm_config: VllmConfig, layout: RegionLayout, local: LocalEntries
) -> RemoteSource:
    """The scheduler's remote source for this engine's peer settings."""
    from ec_transfer_nixl.source import NixlRemoteSource

    return NixlRemoteSource(vllm_config, layout, local)
