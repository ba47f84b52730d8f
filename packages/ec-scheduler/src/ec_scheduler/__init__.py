"""ec-scheduler: the scheduler half of the EC CPU tier for vLLM, and its connector.

`ECCPUScheduler` decides, per engine step, which encoder outputs to save into
the shared region and which entries to load back, applies the workers'
reports and evicts by policy; every module at this level runs in the
scheduler process only, never maps the region and never imports device code
(with cross-engine peers, the transport's source does map the region in this
process: see `tests/test_import_contracts.py`).
`shell/` holds `ECCPUTierConnector`, the connector vLLM instantiates in every
process, the backend discovery and the plugin that registers its names.

Names are imported on first use (vLLM's plugin loader imports this package).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_core.lazy import lazy_exports

_EXPORTS = {
    "ECCPUScheduler": "ec_scheduler.scheduler",
    "ECCPUTierConnector": "ec_scheduler.shell.connector",
    "Backend": "ec_scheduler.shell.backends",
    "SchedulerCounters": "ec_scheduler.counters",
}

__all__ = ["Backend", "ECCPUScheduler", "ECCPUTierConnector", "SchedulerCounters"]

if TYPE_CHECKING:
    from ec_scheduler.counters import SchedulerCounters
    from ec_scheduler.scheduler import ECCPUScheduler
    from ec_scheduler.shell.backends import Backend
    from ec_scheduler.shell.connector import ECCPUTierConnector

__getattr__ = lazy_exports(__name__, _EXPORTS)
