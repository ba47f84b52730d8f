"""Lazy package attributes (PEP 562), so importing a package stays cheap.

A package lists `{name: "module.path"}` and sets `__getattr__ =
lazy_exports(__name__, that_dict)`; `package.Name` then imports its module on
first access. vLLM's plugin loader and `ec_connector_module_path` lookups
import our packages; this keeps those imports free of torch and vLLM.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `exports[name]` and returns its `name`."""

    def module_getattr(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return module_getattr
