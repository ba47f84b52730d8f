"""vLLM's own encoder cache, as the connector sees it.

An item without input (`ec_scheduler.inputs`) can still be served when vLLM's
encoder cache holds it (another request encoded or loaded it), and only then
is it no reason to fail its request (`ECCPUScheduler.ensure_cache_available`).
vLLM gives a connector no view of that cache, so the first scheduler-side
connector built in a process wraps `Scheduler.add_request` (`AsyncScheduler`
inherits it): once vLLM has taken a request, a connector of this project is
given the scheduler's encoder cache manager, before any step asks it about
that request.

Guarantees: another connector, or none, is untouched; installing twice is a
no-op; a vLLM without that method or that manager is left alone (items
without input then count as held by no one in vLLM).
"""

from __future__ import annotations

from typing import Any

from ec_scheduler.shell.wrapping import wrap_once

_MARK = "_ec_cpu_tier_own_cache"


def _show_cache(scheduler: Any) -> None:
    """After vLLM took a request: a connector of this project sees its encoder cache."""
    see = getattr(getattr(scheduler, "ec_connector", None), "see_vllm_encoder_cache", None)
    manager = getattr(scheduler, "encoder_cache_manager", None)
    if callable(see) and manager is not None:
        see(manager)


def install() -> bool:
    """Wrap `Scheduler.add_request`; True if this call installed it."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return False
    return wrap_once(Scheduler, "add_request", _MARK, _show_cache)
