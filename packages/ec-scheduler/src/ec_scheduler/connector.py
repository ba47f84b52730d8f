"""The connector shell with its scheduler half filled in.

Backends subclass `ECCPUTierConnector` and name their worker class; the
scheduler role then gets an `ECCPUScheduler`, the worker role the backend's
worker (imported only in worker processes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_core.connector import ECCPUConnectorBase
from ec_scheduler.scheduler import ECCPUScheduler

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class ECCPUTierConnector(ECCPUConnectorBase):
    """Role-routed connector: ECCPUScheduler in the scheduler process."""

    def _make_scheduler(self, vllm_config: VllmConfig) -> ECCPUScheduler:
        return ECCPUScheduler(vllm_config)
