"""Validated settings read from `ec_transfer_config.ec_connector_extra_config`.

Every process of an engine (scheduler and each worker) parses the same dict,
so a malformed value stops the engine at start-up with the same message
everywhere, before any region file exists.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ec_core._vllm import get_logger
from ec_core.sizes import SizeError, format_bytes, parse_byte_size

logger = get_logger(__name__)

KEY_CPU_BYTES = "ec_cpu_bytes"
KEY_REGION_DIR = "ec_cpu_dir"
KEY_OPEN_TIMEOUT = "ec_region_open_timeout_s"

DEFAULT_REGION_DIR = Path("/dev/shm")
DEFAULT_OPEN_TIMEOUT_S = 120.0

# Keys other parts of vLLM's EC connector family use; passing them to this
# connector is harmless, so they are not reported as unknown.
_TOLERATED_FOREIGN_KEYS = frozenset({"ec_enable_nixl", "consumer_ack_timeout_s"})

KNOWN_KEYS: frozenset[str] = frozenset({KEY_CPU_BYTES, KEY_REGION_DIR, KEY_OPEN_TIMEOUT})


def _invalid(key: str, value: object, reason: str) -> ValueError:
    return ValueError(f"ec_connector_extra_config[{key!r}] = {value!r} is invalid: {reason}")


@dataclass(frozen=True, slots=True)
class ECCPUSettings:
    """The connector's settings, each already checked.

    Guarantees: `cpu_bytes` is a whole number of bytes holding at least one
    block; `region_dir` is an absolute path to an existing, writable
    directory; `open_timeout_s` is finite and positive.
    """

    cpu_bytes: int
    region_dir: Path = DEFAULT_REGION_DIR
    open_timeout_s: float = DEFAULT_OPEN_TIMEOUT_S

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, object] | None, *, block_size_bytes: int
    ) -> ECCPUSettings:
        """Parse and validate `extra`; raise ValueError naming key and value.

        `block_size_bytes` is the size of one region block (one embedding
        row); a region smaller than one block is refused here.
        """
        if block_size_bytes <= 0:
            raise ValueError(f"block size must be positive, got {block_size_bytes}")
        extra = dict(extra or {})
        _warn_unknown_keys(extra)

        if KEY_CPU_BYTES not in extra:
            raise ValueError(
                f"ec_connector_extra_config[{KEY_CPU_BYTES!r}] is required: the size of "
                "the host region, e.g. {'ec_cpu_bytes': '8GiB'}"
            )
        raw_bytes = extra[KEY_CPU_BYTES]
        try:
            cpu_bytes = parse_byte_size(raw_bytes)
        except SizeError as exc:
            raise _invalid(KEY_CPU_BYTES, raw_bytes, str(exc)) from None
        if cpu_bytes < block_size_bytes:
            raise _invalid(
                KEY_CPU_BYTES,
                raw_bytes,
                f"{cpu_bytes} bytes is smaller than one block ({block_size_bytes} bytes, "
                "one embedding row of the model)",
            )

        region_dir = _parse_dir(extra.get(KEY_REGION_DIR, DEFAULT_REGION_DIR))
        open_timeout = _parse_positive_seconds(
            KEY_OPEN_TIMEOUT, extra.get(KEY_OPEN_TIMEOUT, DEFAULT_OPEN_TIMEOUT_S)
        )
        return cls(cpu_bytes=cpu_bytes, region_dir=region_dir, open_timeout_s=open_timeout)

    def describe(self) -> str:
        """A one-line summary for start-up logs."""
        return f"{format_bytes(self.cpu_bytes)} in {self.region_dir}"


def _warn_unknown_keys(extra: Mapping[str, object]) -> None:
    unknown = sorted(
        str(key) for key in extra if key not in KNOWN_KEYS and key not in _TOLERATED_FOREIGN_KEYS
    )
    if unknown:
        logger.warning(
            "Ignoring unknown ec_connector_extra_config keys %s; known keys are %s",
            unknown,
            sorted(KNOWN_KEYS),
        )


def _parse_dir(raw: object) -> Path:
    if isinstance(raw, bool) or not isinstance(raw, (str, os.PathLike)):
        raise _invalid(KEY_REGION_DIR, raw, "expected a directory path")
    text = os.fspath(raw)
    if not isinstance(text, str) or not text.strip():
        raise _invalid(KEY_REGION_DIR, raw, "expected a non-empty directory path")
    path = Path(text).expanduser().absolute()
    if not path.is_dir():
        raise _invalid(KEY_REGION_DIR, raw, f"{path} is not an existing directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise _invalid(KEY_REGION_DIR, raw, f"{path} is not writable by this user")
    return path


def _parse_positive_seconds(key: str, raw: object) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise _invalid(key, raw, "expected a number of seconds")
    try:
        seconds = float(raw)
    except ValueError:
        raise _invalid(key, raw, "expected a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise _invalid(key, raw, "expected a finite, positive number of seconds")
    return seconds
