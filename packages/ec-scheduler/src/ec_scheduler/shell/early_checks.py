"""Configuration checks where the user builds vLLM's config, before any engine process starts.

Without them a malformed `ec_connector_extra_config` is first parsed in an
engine's worker process, some 25 s into start-up, and the user sees vLLM's
"Engine core initialization failed" while the clear `ValueError` sits in that
worker's log. vLLM offers a connector no hook in the front-end process, so the
general plugin (`shell.plugin`, which vLLM loads before it builds a config, in
the `LLM` constructor and in the CLI parser alike) wraps `VllmConfig.__post_init__`
(`shell.vllm_patches.CONFIG_CHECKS`): once vLLM's own checks pass, a config whose
`ec_transfer_config` names this connector is checked here as the engine would
check it, and the same error is raised right there, to the caller.

Guarantees:
  * only configs that vLLM resolves to this connector (its name or a backend's
    alias, whatever the module path; an unregistered name with a module path
    inside this project's packages) are looked at; every other config is
    untouched;
  * what raises here is exactly what the engine would raise later: a
    `ValueError` from the settings parser (region size, policy, peers, ...) or
    the `BackendError` naming the package to install; any other surprise is
    logged at debug level and left for the engine to report.
"""

from __future__ import annotations

from typing import Any

from ec_scheduler.shell import backends

_OUR_MODULES = ("ec_scheduler", "ec_worker_", "ec_transfer_")


def names_this_connector(ec_config: Any) -> bool:
    """Whether an `ECTransferConfig` selects this project's connector.

    Decided in vLLM's own order (`ECConnectorFactory.get_connector_class`): a
    registered name wins over `ec_connector_module_path`, so our name (or an
    installed backend's alias) is ours whatever the module path, and another
    registered connector's name is not ours even with our module path.
    """
    name = getattr(ec_config, "ec_connector", None)
    if not name:
        return False
    if name == backends.CONNECTOR_NAME:
        return True
    try:
        if backends.backend_named(name) is not None:
            return True
    except backends.BackendError:
        return False
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    registry = getattr(ECConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and name in registry:
        return False  # another connector's name: vLLM ignores the module path
    module = getattr(ec_config, "ec_connector_module_path", None) or ""
    return bool(module) and module.startswith(_OUR_MODULES)


def check(vllm_config: Any) -> None:
    """Raise now what this connector would raise when the engine builds it (see module doc)."""
    ec_config = getattr(vllm_config, "ec_transfer_config", None)
    if ec_config is None or not names_this_connector(ec_config):
        return
    from ec_core.layout import region_layout

    try:
        region_layout(vllm_config)
        backends.backend_for(backends.current_device_type())
    except (ValueError, backends.BackendError):
        raise
    except Exception as exc:  # not ours to judge here: the engine will report it
        from ec_core._vllm import get_logger

        get_logger(__name__).debug("EC CPU tier: early configuration check skipped: %r", exc)
