"""Every change this project makes to vLLM's own classes: three methods wrapped.

vLLM tells an EC connector nothing of three events this connector must act on,
so each is heard by wrapping the one vLLM method where it happens; once the
original has returned, our code runs:

* `VllmConfig.__post_init__`, wrapped by `install_config_checks` (from the
  general plugin, in every process, before vLLM builds a config): a config
  naming this connector is checked where the user builds it
  (`early_checks.check`);
* `Scheduler.add_request`, wrapped by `install_scheduler_hooks` when a
  scheduler-role connector is built: the connector is shown vLLM's encoder
  cache manager (`own_cache`);
* `Scheduler.reset_encoder_cache`, wrapped by `install_scheduler_hooks` too:
  the connector forgets its region's entries (the model's weights changed).

What each wrap relies on in vLLM is stated once, in `PATCHES`;
`packages/ec-scheduler/tests/test_vllm_patches.py` checks every item against
the installed vLLM and fails naming the wrap and the item when one no longer
holds.

Guarantees (of `wrap_once`, so of all three): the wrapped method does what
the original did, with the same arguments, result and exceptions, then calls
`after(self)` (not when the original raised); a method already wrapped under
the same mark is left as it is (a second install is a no-op), and so is a vLLM
without that class or method. `after` hooks touch only a connector of this
project: every other connector, or none, is untouched.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ec_scheduler.shell import early_checks


@dataclass(frozen=True)
class Patch:
    """One wrapped vLLM method and what the wrap relies on in vLLM."""

    owner: str
    """`"module:Class"`."""
    method: str
    mark: str
    """The attribute that marks the wrapper (installing twice is a no-op)."""
    parameters: tuple[str, ...]
    """The method's parameters, as the wrap and its hook assume them."""
    inherited_by: tuple[str, ...]
    """Subclasses (`"module:Class"`) that must not override the method: the wrap on
    `owner` reaches them only through inheritance."""
    called_from: tuple[tuple[str, str], ...]
    """`("module:Class.function", "source text")`: where vLLM calls the method on the
    path the wrap relies on (the text is part of that function's source)."""
    instance_attributes: tuple[str, ...]
    """Attributes the hook reads from the instance (vLLM sets them in `__init__`)."""
    relies_on: str

    def resolve(self) -> type | None:
        """The owner class, or None when this vLLM lacks it."""
        module, _, name = self.owner.partition(":")
        try:
            cls: type = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None
        return cls


CONFIG_CHECKS = Patch(
    owner="vllm.config:VllmConfig",
    method="__post_init__",
    mark="_ec_cpu_tier_early_checks",
    parameters=("self",),
    inherited_by=(),
    called_from=(("vllm.engine.arg_utils:EngineArgs.create_engine_config", "VllmConfig("),),
    instance_attributes=("ec_transfer_config",),
    relies_on=(
        "VllmConfig is a dataclass whose generated __init__ calls self.__post_init__() (looked "
        "up at call time, so a wrapper set on the class runs) once every field is set and "
        "after vLLM's own checks, in the process that builds the config: the LLM "
        "constructor and the CLI both build it through EngineArgs.create_engine_config; "
        "ec_transfer_config is an attribute by then"
    ),
)
ADD_REQUEST = Patch(
    owner="vllm.v1.core.sched.scheduler:Scheduler",
    method="add_request",
    mark="_ec_cpu_tier_own_cache",
    parameters=("self", "request"),
    inherited_by=("vllm.v1.core.sched.async_scheduler:AsyncScheduler",),
    called_from=(("vllm.v1.engine.core:EngineCore.add_request", "self.scheduler.add_request("),),
    instance_attributes=("ec_connector", "encoder_cache_manager"),
    relies_on=(
        "the engine core hands every new request to Scheduler.add_request(request) before "
        "any schedule() step sees it; AsyncScheduler inherits it; the scheduler holds its "
        "EC connector as ec_connector (None without one) and vLLM's encoder cache as "
        "encoder_cache_manager (whose cached/freeable/num_free_slots `own_cache.readable` "
        "checks before use)"
    ),
)
RESET_ENCODER_CACHE = Patch(
    owner="vllm.v1.core.sched.scheduler:Scheduler",
    method="reset_encoder_cache",
    mark="_ec_cpu_tier_weight_updates",
    parameters=("self",),
    inherited_by=("vllm.v1.core.sched.async_scheduler:AsyncScheduler",),
    called_from=(
        ("vllm.v1.engine.core:EngineCore.reset_encoder_cache", "scheduler.reset_encoder_cache()"),
    ),
    instance_attributes=("ec_connector",),
    relies_on=(
        "the engine core resets vLLM's encoder cache (after a weight update, e.g. "
        "pause_generation(clear_cache=True)) through Scheduler.reset_encoder_cache(), with "
        "no argument; AsyncScheduler inherits it; the scheduler holds its EC connector as "
        "ec_connector"
    ),
)
PATCHES = (CONFIG_CHECKS, ADD_REQUEST, RESET_ENCODER_CACHE)


def wrap_once(owner: type, name: str, mark: str, after: Callable[[Any], object]) -> bool:
    """Wrap `owner.<name>` to call `after(self)` once it returns; True if this call
    wrapped it, False if `owner` has no such method or it already carries `mark`."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, mark, False):
        return False

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        after(self)
        return result

    setattr(wrapper, mark, True)
    setattr(owner, name, wrapper)
    return True


def _install(patch: Patch, after: Callable[[Any], object]) -> bool:
    owner = patch.resolve()
    return owner is not None and wrap_once(owner, patch.method, patch.mark, after)


def _check_config(config: Any) -> None:
    """After vLLM built a config: check it if it names this connector."""
    early_checks.check(config)  # looked up at each call, not bound at install: tests patch it


def _show_cache(scheduler: Any) -> None:
    """After vLLM took a request: a connector of this project sees its encoder cache."""
    see = getattr(getattr(scheduler, "ec_connector", None), "see_vllm_encoder_cache", None)
    manager = getattr(scheduler, "encoder_cache_manager", None)
    if callable(see) and manager is not None:
        see(manager)


def _reset_region(scheduler: Any) -> None:
    """After vLLM's reset: a connector of this project forgets its entries too."""
    reset = getattr(getattr(scheduler, "ec_connector", None), "reset_encoder_outputs", None)
    if callable(reset):
        reset()


def install_config_checks() -> bool:
    """Wrap `VllmConfig.__post_init__` (see `CONFIG_CHECKS`); True if this call installed it."""
    return _install(CONFIG_CHECKS, _check_config)


def install_scheduler_hooks() -> tuple[bool, bool]:
    """Wrap `Scheduler.reset_encoder_cache` (`RESET_ENCODER_CACHE`: vLLM's encoder-cache
    reset reaches the region) and `Scheduler.add_request` (`ADD_REQUEST`: the connector
    sees vLLM's encoder cache); whether this call installed each."""
    return _install(RESET_ENCODER_CACHE, _reset_region), _install(ADD_REQUEST, _show_cache)
