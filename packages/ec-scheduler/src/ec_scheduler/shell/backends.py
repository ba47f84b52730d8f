"""Which backend serves this host: backends announce themselves, vLLM's platform picks one.

Runs in every process that builds the connector, and in vLLM's plugin loader:
it imports neither vLLM nor torch when loaded, and a backend's worker module is
imported only by `load_worker_class`, in worker processes.

A backend package announces itself with one entry point in the group
`ec_cpu_tier.backends` whose value is the `Backend` describing it, defined in
the package's `__init__` so that loading it stays cheap:

    [project.entry-points."ec_cpu_tier.backends"]
    cpu = "ec_worker_cpu:BACKEND"
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENTRY_POINT_GROUP = "ec_cpu_tier.backends"
CONNECTOR_NAME = "ECCPUTierConnector"
CONNECTOR_PATH = "ec_scheduler.shell.connector:ECCPUTierConnector"

KNOWN_DISTRIBUTIONS = {"cpu": "ec-worker-cpu", "cuda": "ec-worker-cuda", "npu": "ec-worker-ascend"}
"""This project's backend package for each vLLM device type: what to install when
none is (the only place that names them; nothing here imports them)."""


class BackendError(RuntimeError):
    """No usable backend for this host; the message says what to install or fix."""


@dataclass(frozen=True)
class Backend:
    """What a backend package announces.

    `device_type` is the `current_platform.device_type` of vLLM it serves
    ("cpu", "cuda", "npu"); `worker` is `"module:Class"` of its ECCPUWorker
    subclass; `alias` is the connector name it was used under before
    ECCPUTierConnector, which keeps working.
    """

    device_type: str
    worker: str
    distribution: str
    alias: str | None = None

    @property
    def worker_name(self) -> str:
        return self.worker.rpartition(":")[2]

    def module_getattr(self, package: str) -> Callable[[str], Any]:
        """The backend package's `__getattr__`: its worker class, and the connector
        under its own name and under the alias (so `ec_connector_module_path` may
        name the backend package), each imported on first access."""
        from ec_core.lazy import lazy_exports

        names = {self.worker_name: self.worker, CONNECTOR_NAME: CONNECTOR_PATH}
        if self.alias:
            names[self.alias] = CONNECTOR_PATH
        return lazy_exports(package, names)


def _warn(message: str, *args: object) -> None:
    from ec_core._vllm import get_logger  # imports vLLM: only when there is something to say

    get_logger(__name__).warning(message, *args)


def installed_backends() -> dict[str, Backend]:
    """Every announced backend by device type.

    An announcement that cannot be loaded, or is not a Backend, is skipped with a
    warning. Two backends for one device type raise BackendError naming both.
    """
    found: dict[str, Backend] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            backend = entry.load()
        except Exception as exc:
            _warn(
                "EC CPU tier: cannot load backend entry point %s (%s): %s",
                entry.name,
                entry.value,
                exc,
            )
            continue
        if not isinstance(backend, Backend):
            _warn(
                "EC CPU tier: entry point %s (%s) is not a Backend; ignored",
                entry.name,
                entry.value,
            )
            continue
        other = found.get(backend.device_type)
        if other is not None and other != backend:
            raise BackendError(
                f"EC CPU tier: two installed backends serve vLLM device type "
                f"{backend.device_type!r}: {other.distribution} and {backend.distribution}; "
                "uninstall one"
            )
        found[backend.device_type] = backend
    return found


def current_device_type() -> str:
    """vLLM's platform on this host ("cpu", "cuda", "npu", ...)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def backend_for(device_type: str, backends: dict[str, Backend] | None = None) -> Backend:
    """The installed backend serving `device_type`, or BackendError naming what to install."""
    installed = installed_backends() if backends is None else backends
    backend = installed.get(device_type)
    if backend is not None:
        return backend
    hint = KNOWN_DISTRIBUTIONS.get(device_type)
    have = ", ".join(f"{b.distribution} ({t})" for t, b in sorted(installed.items())) or "none"
    what = (
        f"install {hint} (pip install {hint})" if hint else "this project has no backend for it yet"
    )
    raise BackendError(
        f"EC CPU tier: vLLM's platform on this host is {device_type!r} and no installed "
        f"backend serves it (installed: {have}); {what}"
    )


def backend_named(connector_name: str | None) -> Backend | None:
    """The installed backend whose alias is `connector_name`, if any."""
    if not connector_name or connector_name == CONNECTOR_NAME:
        return None
    return next((b for b in installed_backends().values() if b.alias == connector_name), None)


def load_worker_class(path: str) -> type[Any]:
    """Import `"module:Class"` (worker processes only: it imports device code)."""
    module_name, _, class_name = path.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"expected 'module:Class', got {path!r}")
    return getattr(importlib.import_module(module_name), class_name)  # type: ignore[no-any-return]
