"""Validated settings read from `ec_transfer_config.ec_connector_extra_config`.

Every process of an engine (scheduler and each worker) parses the same dict,
so a malformed value stops the engine at start-up with the same message
everywhere, before any region file exists.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ec_core import peer_settings
from ec_core._vllm import get_logger
from ec_core.peer_settings import PeerSettings, parse_peer_settings
from ec_core.policy_names import DEFAULT_POLICY, POLICY_NAMES
from ec_core.sizes import SizeError, parse_byte_size

logger = get_logger(__name__)

KEY_CPU_BYTES = "ec_cpu_bytes"
KEY_REGION_DIR = "ec_cpu_dir"
KEY_OPEN_TIMEOUT = "ec_region_open_timeout_s"
KEY_REPORT_TIMEOUT_STEPS = "ec_report_timeout_steps"
KEY_REPORT_TIMEOUT_S = "ec_report_timeout_s"
KEY_POLICY = "ec_eviction_policy"
KEY_ISOLATE_CACHE_SALT = "ec_isolate_cache_salt"
KEY_ACCESS_LOG = "ec_access_log"
KEY_ACCESS_LOG_MAX_BYTES = "ec_access_log_max_bytes"

DEFAULT_REGION_DIR = Path("/dev/shm")
DEFAULT_OPEN_TIMEOUT_S = 120.0
DEFAULT_REPORT_TIMEOUT_STEPS = 64
DEFAULT_REPORT_TIMEOUT_S = 30.0
DEFAULT_ACCESS_LOG_MAX_BYTES = 64 * 2**20
MIN_ACCESS_LOG_MAX_BYTES = 4096
"""The smallest log bound accepted: room for the header and some records."""

# Keys other parts of vLLM's EC connector family use; passing them to this
# connector is harmless, so they are not reported as unknown.
_TOLERATED_FOREIGN_KEYS = frozenset({"ec_enable_nixl", "consumer_ack_timeout_s"})

KNOWN_KEYS: frozenset[str] = frozenset(
    {
        KEY_CPU_BYTES,
        KEY_REGION_DIR,
        KEY_OPEN_TIMEOUT,
        KEY_REPORT_TIMEOUT_STEPS,
        KEY_REPORT_TIMEOUT_S,
        KEY_POLICY,
        KEY_ISOLATE_CACHE_SALT,
        KEY_ACCESS_LOG,
        KEY_ACCESS_LOG_MAX_BYTES,
        *peer_settings.KEYS,
    }
)


def _invalid(key: str, value: object, reason: str) -> ValueError:
    return ValueError(f"ec_connector_extra_config[{key!r}] = {value!r} is invalid: {reason}")


@dataclass(frozen=True, slots=True)
class ECCPUSettings:
    """The connector's settings, each already checked.

    Guarantees: `cpu_bytes` is a whole number of bytes holding at least one
    block; `region_dir` is an absolute path to an existing, writable
    directory; `open_timeout_s` is finite and positive; the report timeouts
    are finite, non-negative and not both zero; `policy` names a known policy;
    `isolate_cache_salt` is a bool; `access_log` is None or an absolute path whose
    directory exists and is writable; `access_log_max_bytes` is at least
    `MIN_ACCESS_LOG_MAX_BYTES`; `peers` is None unless a cross-engine key is set
    (`ec_core.peer_settings`).

    A save or load whose report has not arrived is overdue once it is older
    than `report_timeout_steps` engine steps that reached the workers AND
    older than `report_timeout_s` seconds (0 switches a dimension off); the
    same bound declares a silent rank gone (see ec_scheduler.flights). Both
    must pass, so a long idle period alone (no steps) or a burst of fast
    steps alone (little time) never counts against a copy that is merely late.
    """

    cpu_bytes: int = field(metadata={"key": KEY_CPU_BYTES})
    """Size of the region: an int, `8e9`, `"512MiB"`, `"8GiB"` (binary, 1024-based)
    or `"8GB"` (decimal, 1000-based), at most 4 EiB and at least one block (one
    embedding row of the model). It is host memory, on top of what vLLM reserves."""
    region_dir: Path = field(default=DEFAULT_REGION_DIR, metadata={"key": KEY_REGION_DIR})
    """Directory of the region file: an existing directory this user can read and
    write. A tmpfs (the default) keeps the region in memory; one without a size
    limit (ramfs, `size=0`) is held against the host's memory."""
    open_timeout_s: float = field(
        default=DEFAULT_OPEN_TIMEOUT_S, metadata={"key": KEY_OPEN_TIMEOUT}
    )
    """Seconds to wait while another process creates a region in the same directory."""
    report_timeout_steps: int = field(
        default=DEFAULT_REPORT_TIMEOUT_STEPS, metadata={"key": KEY_REPORT_TIMEOUT_STEPS}
    )
    """Worker steps after which a copy whose report has not arrived is reclaimed as
    lost (together with `ec_report_timeout_s`; 0 switches this bound off)."""
    report_timeout_s: float = field(
        default=DEFAULT_REPORT_TIMEOUT_S, metadata={"key": KEY_REPORT_TIMEOUT_S}
    )
    """Seconds after which a copy whose report has not arrived is reclaimed as lost
    (together with `ec_report_timeout_steps`; 0 switches this bound off, not both)."""
    policy: str = field(default=DEFAULT_POLICY, metadata={"key": KEY_POLICY})
    """Eviction and admission policy: `wtinylfu` (adaptive W-TinyLFU: an LRU window
    in front of a main part ordered by request count, with a recency mode while a
    shadow LRU would serve more and a doorkeeper for one-offs), `s3lfu` (adaptive
    admission, probation and LFU) or `lru`."""
    isolate_cache_salt: bool = field(default=True, metadata={"key": KEY_ISOLATE_CACHE_SALT})
    """Serve an entry saved for a request with vLLM's `cache_salt` only to requests
    with the same salt, here and through peers (`docs/tenant-isolation.md`);
    requests without a salt share among themselves. `false` where all tenants are
    one party: entries are then shared whatever the salt."""
    access_log: Path | None = field(
        default=None, metadata={"key": KEY_ACCESS_LOG, "default": "unset (off)"}
    )
    """Opt-in access log for sizing the region (`docs/sizing.md`): a file path, off
    by default. A consumer's scheduler writes one line per item vLLM schedules (time,
    a digest of the item's key, rows, bytes), never an identifier or a salt; the file
    is created owner-only (0600), replacing one already there, and an engine of
    data-parallel index N > 0 writes `<path>.dpN`. `ec-cpu-sizing --log` replays it."""
    access_log_max_bytes: int = field(
        default=DEFAULT_ACCESS_LOG_MAX_BYTES,
        metadata={"key": KEY_ACCESS_LOG_MAX_BYTES, "default": "`64MiB`"},
    )
    """The access log's size bound (same forms as `ec_cpu_bytes`, at least 4096): the
    file never grows past it; once full the log stops, with one warning."""
    peers: PeerSettings | None = None

    @classmethod
    def from_extra_config(
        cls,
        extra: Mapping[str, object] | None,
        *,
        block_size_bytes: int,
        role: str | None = None,
        dp_index: int = 0,
    ) -> ECCPUSettings:
        """Parse and validate `extra`; raise ValueError naming key and value.

        `block_size_bytes` is the size of one region block (one embedding
        row); a region smaller than one block is refused here. `role` (the
        `ec_role`) lets the cross-engine keys be checked against it, and
        `dp_index` (the engine's data-parallel index) gives its listen port
        (`ec_core.peer_settings.parse_peer_settings`).
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
        cpu_bytes = _parse_size(
            KEY_CPU_BYTES,
            extra[KEY_CPU_BYTES],
            at_least=block_size_bytes,
            minimum=f"one block ({block_size_bytes} bytes, one embedding row of the model)",
        )

        region_dir = _parse_dir(extra.get(KEY_REGION_DIR, DEFAULT_REGION_DIR))
        open_timeout = _parse_seconds(
            KEY_OPEN_TIMEOUT, extra.get(KEY_OPEN_TIMEOUT, DEFAULT_OPEN_TIMEOUT_S), allow_zero=False
        )
        timeout_steps = _parse_count(
            KEY_REPORT_TIMEOUT_STEPS,
            extra.get(KEY_REPORT_TIMEOUT_STEPS, DEFAULT_REPORT_TIMEOUT_STEPS),
        )
        timeout_s = _parse_seconds(
            KEY_REPORT_TIMEOUT_S,
            extra.get(KEY_REPORT_TIMEOUT_S, DEFAULT_REPORT_TIMEOUT_S),
            allow_zero=True,
        )
        if timeout_steps == 0 and timeout_s == 0:
            raise _invalid(
                KEY_REPORT_TIMEOUT_S,
                extra.get(KEY_REPORT_TIMEOUT_S),
                f"{KEY_REPORT_TIMEOUT_STEPS} and {KEY_REPORT_TIMEOUT_S} cannot both be 0: "
                "every copy would be reclaimed before its report could arrive",
            )
        policy = _parse_choice(KEY_POLICY, extra.get(KEY_POLICY, DEFAULT_POLICY), POLICY_NAMES)
        isolate = extra.get(KEY_ISOLATE_CACHE_SALT, True)
        if not isinstance(isolate, bool):
            raise _invalid(KEY_ISOLATE_CACHE_SALT, isolate, "expected true or false")
        access_log = _parse_log_path(extra.get(KEY_ACCESS_LOG))
        log_max = _parse_size(
            KEY_ACCESS_LOG_MAX_BYTES,
            extra.get(KEY_ACCESS_LOG_MAX_BYTES, DEFAULT_ACCESS_LOG_MAX_BYTES),
            at_least=MIN_ACCESS_LOG_MAX_BYTES,
            minimum=f"the least accepted ({MIN_ACCESS_LOG_MAX_BYTES} bytes)",
        )
        peers = parse_peer_settings(extra, role, dp_index=dp_index)
        return cls(
            cpu_bytes=cpu_bytes,
            region_dir=region_dir,
            open_timeout_s=open_timeout,
            report_timeout_steps=timeout_steps,
            report_timeout_s=timeout_s,
            policy=policy,
            isolate_cache_salt=isolate,
            access_log=access_log,
            access_log_max_bytes=log_max,
            peers=peers,
        )


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


def _parse_size(key: str, raw: object, *, at_least: int, minimum: str) -> int:
    """`raw` as a number of bytes (`ec_core.sizes`) of at least `at_least`, or
    ValueError naming `key`; `minimum` says what that least is."""
    try:
        size = parse_byte_size(raw)
    except SizeError as exc:
        raise _invalid(key, raw, str(exc)) from None
    if size < at_least:
        raise _invalid(key, raw, f"{size} bytes is smaller than {minimum}")
    return size


def _parse_path(key: str, raw: object, what: str) -> Path:
    """`raw` as an absolute path (`~` expanded), or ValueError naming `key`; `what`
    says what the path names ("directory", "file")."""
    if isinstance(raw, bool) or not isinstance(raw, (str, os.PathLike)):
        raise _invalid(key, raw, f"expected a {what} path")
    text = os.fspath(raw)
    if not isinstance(text, str) or not text.strip():
        raise _invalid(key, raw, f"expected a non-empty {what} path")
    try:
        return Path(text).expanduser().absolute()
    except RuntimeError as exc:  # `~user` naming no user, or `~` with no home directory
        raise _invalid(key, raw, f"cannot expand '~': {exc}") from None


def _is_dir(key: str, raw: object, path: Path) -> bool:
    """`path.is_dir()`, or ValueError naming `key` when the path cannot be looked at."""
    try:
        return path.is_dir()
    except OSError as exc:  # a parent this user cannot search (EACCES), a name too long
        raise _invalid(key, raw, f"cannot look at {_shown(path)}: {exc.strerror}") from None


def _parse_dir(raw: object) -> Path:
    path = _parse_path(KEY_REGION_DIR, raw, "directory")
    if not _is_dir(KEY_REGION_DIR, raw, path):
        raise _invalid(KEY_REGION_DIR, raw, f"{_shown(path)} is not an existing directory")
    # Read too: workers open the directory to lock it and list it for stale files.
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise _invalid(
            KEY_REGION_DIR, raw, f"{_shown(path)} is not readable and writable by this user"
        )
    return path


def _parse_log_path(raw: object) -> Path | None:
    """The access log's path (None: off). Its directory must exist and be writable
    now, so that a typo stops the engine at start-up rather than losing the log."""
    if raw is None:
        return None
    path = _parse_path(KEY_ACCESS_LOG, raw, "file")
    if _is_dir(KEY_ACCESS_LOG, raw, path):
        raise _invalid(KEY_ACCESS_LOG, raw, f"{_shown(path)} is a directory, not a file path")
    if not _is_dir(KEY_ACCESS_LOG, raw, path.parent):
        raise _invalid(KEY_ACCESS_LOG, raw, f"{_shown(path.parent)} is not an existing directory")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise _invalid(KEY_ACCESS_LOG, raw, f"{_shown(path.parent)} is not writable by this user")
    return path


def _shown(path: Path) -> str:
    """`path` for a message: bytes that are not UTF-8 (lone surrogates in the text, as
    Python decodes them from the command line) as `\\xNN`, so that the message can
    be encoded (pydantic, which carries the early check's error, must)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _parse_seconds(key: str, raw: object, *, allow_zero: bool) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise _invalid(key, raw, "expected a number of seconds")
    try:
        seconds = float(raw)
    except (ValueError, OverflowError):
        raise _invalid(key, raw, "expected a number of seconds") from None
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = "non-negative" if allow_zero else "positive"
        raise _invalid(key, raw, f"expected a finite, {bound} number of seconds")
    return seconds


def _parse_count(key: str, raw: object) -> int:
    if isinstance(raw, bool):
        raise _invalid(key, raw, "expected a whole number")
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, str) and raw.strip().isdigit():
        try:
            raw = int(raw)
        except ValueError:  # digits int() does not read ('²'), or past its length limit
            raise _invalid(key, raw, "expected a whole number >= 0") from None
    if not isinstance(raw, int) or raw < 0:
        raise _invalid(key, raw, "expected a whole number >= 0")
    return raw


def _parse_choice(key: str, raw: object, choices: tuple[str, ...]) -> str:
    if not isinstance(raw, str) or raw.strip().lower() not in choices:
        raise _invalid(key, raw, f"expected one of {', '.join(choices)}")
    return raw.strip().lower()
