"""Registering a backend's connector name with vLLM, from a plugin entry point.

Each backend package declares a `vllm.general_plugins` entry point whose
function calls `register_connector(...)` with strings only. vLLM may load
plugins several times per process and in every process; registering is
therefore idempotent, and nothing of ours is imported until vLLM first
resolves the connector name.
"""

from __future__ import annotations


def register_connector(name: str, module_path: str, class_name: str) -> bool:
    """Register `name` → `module_path:class_name` with vLLM's EC connector factory.

    Returns True if this call registered it, False if the name was already
    registered (by an earlier call or by another package; vLLM keeps the first
    registration of a name).
    """
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    registry = getattr(ECConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and name in registry:
        return False
    try:
        ECConnectorFactory.register_connector(name, module_path, class_name)
    except ValueError as exc:  # a concurrent or foreign registration of the same name
        from ec_core._vllm import get_logger

        get_logger(__name__).debug("%s not registered: %s", name, exc)
        return False
    return True
