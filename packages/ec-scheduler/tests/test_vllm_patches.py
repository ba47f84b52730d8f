"""What the three wraps of vLLM's methods rely on still holds in the installed vLLM.

Each item of each `Patch` (`ec_scheduler.shell.vllm_patches`) is checked on its
own, so a vLLM release that breaks one fails the test that names the wrap and
the item: the class or method is gone, its parameters changed, a subclass now
overrides it (the wrap would no longer reach it), vLLM no longer calls it on the
path the wrap relies on, or an attribute the hook reads is gone. Then each wrap
is driven through vLLM itself and its hook must run.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest

from ec_scheduler.shell import early_checks, vllm_patches
from ec_scheduler.shell.connector import ECCPUTierConnector
from ec_scheduler.shell.vllm_patches import PATCHES, Patch
from ectools.configs import make_vllm_config
from ectools.vllm_scheduler import mm_request, real_scheduler

IDS = [f"{p.owner.rpartition(':')[2]}.{p.method}" for p in PATCHES]


def _resolve(path: str) -> Any:
    """`"module:Qualified.name"` → the object."""
    module, _, qualname = path.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _original(patch: Patch) -> Any:
    owner = patch.resolve()
    assert owner is not None, f"{patch.owner} is gone from vLLM; it relies on: {patch.relies_on}"
    method = getattr(owner, patch.method, None)
    assert method is not None, f"{patch.owner}.{patch.method} is gone; {patch.relies_on}"
    return inspect.unwrap(method)


@pytest.mark.parametrize("patch", PATCHES, ids=IDS)
def test_the_wrapped_method_keeps_its_parameters(patch: Patch) -> None:
    parameters = tuple(inspect.signature(_original(patch)).parameters)
    assert parameters == patch.parameters, (
        f"{patch.owner}.{patch.method} now takes {parameters}, the wrap assumes "
        f"{patch.parameters}; it relies on: {patch.relies_on}"
    )


@pytest.mark.parametrize("patch", PATCHES, ids=IDS)
def test_the_subclasses_still_inherit_the_wrapped_method(patch: Patch) -> None:
    owner = patch.resolve()
    for path in patch.inherited_by:
        subclass = _resolve(path)
        assert issubclass(subclass, owner)  # type: ignore[arg-type]
        overriding = [
            cls.__qualname__
            for cls in subclass.__mro__[: subclass.__mro__.index(owner)]
            if patch.method in vars(cls)
        ]
        assert not overriding, (
            f"{overriding} now override {patch.method}: the wrap on {patch.owner} no longer "
            f"reaches {path}; it relies on: {patch.relies_on}"
        )


@pytest.mark.parametrize("patch", PATCHES, ids=IDS)
def test_vllm_still_calls_the_wrapped_method_where_the_wrap_relies_on_it(patch: Patch) -> None:
    for caller, text in patch.called_from:
        source = inspect.getsource(inspect.unwrap(_resolve(caller)))
        assert text in source, (
            f"{caller} no longer contains {text!r}: vLLM may not call {patch.method} on the "
            f"path the wrap relies on: {patch.relies_on}"
        )


def test_the_instance_attributes_the_hooks_read_are_set_by_vllm(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    scheduler = real_scheduler(tiny_model_dir, tmp_path)
    config = make_vllm_config(tiny_model_dir, extra={"ec_cpu_dir": str(tmp_path)})
    for patch, instance in (
        (vllm_patches.CONFIG_CHECKS, config),
        (vllm_patches.ADD_REQUEST, scheduler),
        (vllm_patches.RESET_ENCODER_CACHE, scheduler),
    ):
        for name in patch.instance_attributes:
            assert hasattr(instance, name), (
                f"{type(instance).__name__} has no {name} any more; {patch.relies_on}"
            )
    assert isinstance(scheduler.ec_connector, ECCPUTierConnector)  # type: ignore[attr-defined]


def test_every_wrap_is_installed_and_its_hook_runs_through_vllm(
    tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[Any] = []
    monkeypatch.setattr(early_checks, "check", checked.append)
    vllm_patches.install_config_checks()
    config = make_vllm_config(
        tiny_model_dir, extra={"ec_cpu_dir": str(tmp_path)}, early_checks=True
    )
    assert checked and checked[-1] is config, "VllmConfig.__post_init__ no longer runs the check"

    scheduler: Any = real_scheduler(tiny_model_dir, tmp_path)  # builds the connector: installs
    for patch in PATCHES:
        wrapped = getattr(patch.resolve(), patch.method)
        assert getattr(wrapped, patch.mark, False), f"{patch.owner}.{patch.method} not wrapped"
    connector = scheduler.ec_connector
    seen: list[Any] = []
    resets: list[bool] = []
    monkeypatch.setattr(connector, "see_vllm_encoder_cache", seen.append)
    monkeypatch.setattr(connector, "reset_encoder_outputs", lambda: resets.append(True))
    scheduler.add_request(mm_request("r", [("X", 8)]))
    assert seen == [scheduler.encoder_cache_manager], "add_request no longer shows the cache"
    scheduler.reset_encoder_cache()
    assert resets == [True], "reset_encoder_cache no longer reaches the connector"


def test_installing_twice_is_a_no_op() -> None:
    vllm_patches.install_config_checks()
    vllm_patches.install_scheduler_hooks()
    wrapped = [getattr(p.resolve(), p.method) for p in PATCHES]
    assert vllm_patches.install_config_checks() is False
    assert vllm_patches.install_scheduler_hooks() == (False, False)
    assert [getattr(p.resolve(), p.method) for p in PATCHES] == wrapped
