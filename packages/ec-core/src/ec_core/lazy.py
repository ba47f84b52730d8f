"""Lazy package attributes (PEP 562), so importing a package stays cheap.

A package lists `{name: "module.path"}` (the attribute of the same name in
that module) or `{name: "module.path:attribute"}` and sets `__getattr__ =
lazy_exports(__name__, that_dict)`; `package.Name` then imports its module on
first access. vLLM's plugin loader and `ec_connector_module_path` lookups
import our packages; this keeps those imports free of torch and vLLM.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports what `exports[name]` names and returns it."""

    def module_getattr(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = target.partition(":")
        return getattr(importlib.import_module(module), attribute or name)

    return module_getattr
