"""ec-scheduler: the scheduler-process half of the EC CPU tier for vLLM.

`ECCPUScheduler` decides, per engine step, which encoder outputs to save into
the shared region and which entries to load back, applies the workers'
reports, and evicts by policy. It never maps the region and never imports
device code. `ECCPUTierConnector` is the connector shell backends subclass.

Names are imported on first use (a backend's plugin imports this package).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_core.lazy import lazy_exports

_EXPORTS = {
    "ECCPUScheduler": "ec_scheduler.scheduler",
    "ECCPUTierConnector": "ec_scheduler.connector",
    "SchedulerCounters": "ec_scheduler.counters",
}

__all__ = ["ECCPUScheduler", "ECCPUTierConnector", "SchedulerCounters"]

if TYPE_CHECKING:
    from ec_scheduler.connector import ECCPUTierConnector
    from ec_scheduler.counters import SchedulerCounters
    from ec_scheduler.scheduler import ECCPUScheduler

__getattr__ = lazy_exports(__name__, _EXPORTS)
