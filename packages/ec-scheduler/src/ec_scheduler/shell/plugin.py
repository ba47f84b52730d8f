"""vLLM general plugin: registers the connector's names with vLLM's EC connector factory.

Declared once, by ec-scheduler (`vllm.general_plugins`). vLLM may load
plugins several times per process and in every process; registering is
therefore idempotent, uses strings only, and nothing of ours beyond
`ec_scheduler.shell.backends`, `.vllm_patches` and `.early_checks` is imported until vLLM first
resolves a name or builds a config that names the connector.
"""

from __future__ import annotations

from ec_scheduler.shell import backends


def register() -> None:
    """Register `ECCPUTierConnector` and every installed backend's alias (all one class),
    and check configurations naming it as soon as vLLM builds them (`shell.early_checks`,
    through `shell.vllm_patches.install_config_checks`)."""
    from ec_scheduler.shell import vllm_patches

    vllm_patches.install_config_checks()
    try:
        aliases = [b.alias for b in backends.installed_backends().values() if b.alias]
    except backends.BackendError:  # conflicting backends: the connector says so when built
        aliases = []
    module, _, cls = backends.CONNECTOR_PATH.partition(":")
    for name in (backends.CONNECTOR_NAME, *aliases):
        register_connector(name, module, cls)


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
    except ValueError:  # registered concurrently by another thread or package
        return False
    return True
