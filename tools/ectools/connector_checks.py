"""Checks every backend's connector must pass: found by module path and by name."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory


def check_connector_resolution(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    module_path: str,
    connector_class: type[ECConnectorBase],
    register: Callable[[], None],
) -> None:
    """vLLM's factory resolves `name` by module path, then, after the plugin
    ran (twice: vLLM loads plugins repeatedly), by the registered name alone."""
    registry = dict(ECConnectorFactory._registry)
    registry.pop(name, None)
    monkeypatch.setattr(ECConnectorFactory, "_registry", registry)
    by_path = ECTransferConfig(
        ec_connector=name, ec_role="ec_both", ec_connector_module_path=module_path
    )
    assert ECConnectorFactory.get_connector_class(by_path) is connector_class
    register()
    register()
    assert name in ECConnectorFactory._registry
    by_name = ECTransferConfig(ec_connector=name, ec_role="ec_both")
    assert ECConnectorFactory.get_connector_class(by_name) is connector_class
