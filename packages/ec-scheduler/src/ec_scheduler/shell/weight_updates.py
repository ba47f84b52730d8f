"""Weight updates reach the region: when vLLM resets its encoder cache, so does the tier.

vLLM resets its encoder cache after the model's weights change
(`reset_encoder_cache`, e.g. `pause_generation(clear_cache=True)` in
reinforcement-learning loops), so that no embedding of the old weights is used
again; it tells an EC connector nothing. The region would go on serving those
embeddings. So the first scheduler-side connector built in a process (in the
engine core, while vLLM builds its `Scheduler`) wraps
`Scheduler.reset_encoder_cache` (`AsyncScheduler` inherits it): once vLLM's own
reset is done, a connector of this project forgets its entries
(`ECCPUTierConnector.reset_encoder_outputs`).

Guarantees: another connector, or none, is untouched; installing twice is a
no-op; a vLLM without that method is left alone. Only this engine's region is
reset: an engine that fetched from peers drops what it fetched, and a producer
whose weights did not change keeps serving its own entries.
"""

from __future__ import annotations

from typing import Any

from ec_scheduler.shell.wrapping import wrap_once

_MARK = "_ec_cpu_tier_weight_updates"


def _reset_region(scheduler: Any) -> None:
    """After vLLM's reset: a connector of this project forgets its entries too."""
    reset = getattr(getattr(scheduler, "ec_connector", None), "reset_encoder_outputs", None)
    if callable(reset):
        reset()


def install() -> bool:
    """Wrap `Scheduler.reset_encoder_cache`; True if this call installed it."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return False
    return wrap_once(Scheduler, "reset_encoder_cache", _MARK, _reset_region)
