"""ec-scheduler: the scheduler-process half of the EC CPU tier for vLLM.

`ECCPUScheduler` decides, per engine step, which encoder outputs to save into
the shared region and which entries to load back, applies the workers'
reports, and evicts by policy. It never maps the region and never imports
device code. `ECCPUTierConnector` is the connector shell backends subclass.
"""

from ec_scheduler.connector import ECCPUTierConnector
from ec_scheduler.counters import SchedulerCounters
from ec_scheduler.scheduler import ECCPUScheduler

__all__ = ["ECCPUScheduler", "ECCPUTierConnector", "SchedulerCounters"]
