"""The shared secrets peers sign with: where they come from, and how they roll.

An engine takes its secrets from `$EC_CPU_TIER_PEER_SECRET` or from the file
named by `ec_peer_secret_file`, never from `ec_connector_extra_config` itself:
vLLM logs its non-default arguments, the whole `ec_transfer_config` included,
at start-up, before the connector runs.

Several secrets may be given: the first signs, any verifies. Rolling a
deployment from secret A to B without restarting every engine at once goes
[A] -> [A, B] -> [B, A] -> [B], each phase on every engine before the next;
with `ec_peer_secret_file` each phase is a rewrite of the file, which a running
engine picks up within a second or two (`PeerSecrets`).

Nothing here ever puts a secret into a message, a log line or an exception.
"""

from __future__ import annotations

import hmac
import os
import re
import stat
import threading
import time
from collections.abc import Callable

from ec_core._vllm import get_logger
from ec_core.ratelimit import RateLimitedWarnings

logger = get_logger(__name__)

KEY_SECRET = "ec_peer_secret"
"""Refused: vLLM would log it (see the module docstring)."""
KEY_SECRET_FILE = "ec_peer_secret_file"
SECRET_ENV = "EC_CPU_TIER_PEER_SECRET"
"""Environment variable holding the secrets, separated by commas or whitespace (empty: unset)."""
MIN_SECRET_CHARS = 8
MAX_SECRET_FILE_BYTES = 64 * 1024
RELOAD_CHECK_S = 1.0
"""A running engine looks at its secret file at most this often."""

_ENV_SEPARATORS = re.compile(r"[,\s]+")


def inline_secret_error() -> ValueError:
    """What an engine says to `ec_peer_secret` in its config (the value is never shown)."""
    return ValueError(
        f"ec_connector_extra_config[{KEY_SECRET!r}] = <hidden> is refused: vLLM logs the "
        "whole ec_transfer_config (its 'non-default args') at start-up, so the secret would "
        f"land in plain text in the engine's log. Remove it and put the secret in "
        f"${SECRET_ENV} (the engine's environment), or in a file readable by its owner only "
        f"(chmod 600) named by {KEY_SECRET_FILE!r}"
    )


def _checked(found: list[str], where: str) -> tuple[str, ...]:
    """`found` as the secrets tuple, or ValueError naming `where` (never a secret)."""
    if not found:
        raise ValueError(f"{where} holds no secret")
    for index, secret in enumerate(found, 1):
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(
                f"{where}: secret {index} of {len(found)} is shorter than {MIN_SECRET_CHARS} "
                "characters"
            )
        try:
            secret.encode()  # what signs and checks every message
        except UnicodeEncodeError:  # lone surrogates: bytes the environment could not decode
            raise ValueError(
                f"{where}: secret {index} of {len(found)} is not text that encodes as UTF-8 "
                "(use hex or base64 of random bytes)"
            ) from None
    if len(set(found)) != len(found):
        raise ValueError(f"{where}: a secret is listed twice")
    return tuple(found)


def secrets_from_env(value: str) -> tuple[str, ...]:
    """The secrets in `$EC_CPU_TIER_PEER_SECRET`'s `value` (separated by commas or
    whitespace); ValueError naming the variable (never a secret) if one is unusable."""
    found = [part for part in _ENV_SEPARATORS.split(value) if part]
    return _checked(found, f"${SECRET_ENV}")


def file_error(path: str, reason: str) -> ValueError:
    return ValueError(f"ec_connector_extra_config[{KEY_SECRET_FILE!r}] = {path!r}: {reason}")


def read_secret_file(path: str) -> tuple[str, ...]:
    """The secrets in the file at `path`, one a line (blank lines and the whitespace around
    each ignored).

    Raises ValueError naming `ec_peer_secret_file` and the path, never a secret, unless
    the file is a regular file of at most MAX_SECRET_FILE_BYTES owned by this process's
    user with no permission for its group or others (chmod 600 or 400), in UTF-8.
    """
    if not os.path.isabs(path):
        raise file_error(path, "expected an absolute path")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise file_error(path, f"cannot be opened: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)  # of what was opened: no race with a swap of the path
        if not stat.S_ISREG(info.st_mode):
            raise file_error(path, "is not a regular file")
        if info.st_uid != os.geteuid():
            raise file_error(
                path, f"is owned by uid {info.st_uid}, not by this engine's user ({os.geteuid()})"
            )
        if info.st_mode & 0o077:
            raise file_error(
                path,
                f"has mode {stat.S_IMODE(info.st_mode):04o}: its group or others may access it; "
                "make it readable by its owner only (chmod 600)",
            )
        data = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise file_error(path, f"cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise file_error(path, f"is larger than {MAX_SECRET_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise file_error(path, "is not UTF-8 text") from None
    found = [line.strip() for line in text.splitlines() if line.strip()]
    return _checked(found, f"ec_connector_extra_config[{KEY_SECRET_FILE!r}] = {path!r}")


def signed_by_any(mac: bytes, body: bytes, accepted: tuple[bytes, ...]) -> bool:
    """Whether `mac` is the HMAC-SHA256 of `body` under one of the `accepted` secrets.

    The first (the signing one) is tried alone first: a message from a process
    that signs as this one does costs one HMAC and no generator.
    """
    if hmac.compare_digest(mac, hmac.digest(accepted[0], body, "sha256")):
        return True
    return any(hmac.compare_digest(mac, hmac.digest(s, body, "sha256")) for s in accepted[1:])


class PeerSecrets:
    """The secrets one process signs (`signing`) and verifies (`accepted`) with, as bytes.

    Guarantees: `accepted` is never empty and starts with `signing`, so checking
    in that order costs one HMAC in the common case. With a `path`
    (`ec_peer_secret_file`) the file is looked at (one `stat`) at most once per
    RELOAD_CHECK_S from whichever thread asks for the secrets, and re-read when it
    changed (another file, size, time or mode); the new secrets replace the old
    in one assignment, so a reader sees the old tuple or the new one, never a mix.
    A file that no longer passes `read_secret_file`'s checks keeps the old
    secrets and is warned about (rate-limited); nothing raises. Safe from any
    thread; one thread at a time re-reads, the others go on with what is there.
    """

    def __init__(
        self,
        secrets: tuple[str, ...],
        path: str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not secrets:
            raise ValueError("PeerSecrets needs at least one secret")
        self._keys: tuple[bytes, ...] = tuple(s.encode() for s in secrets)
        self._path = path
        self._clock = clock
        self._next_check = clock() + RELOAD_CHECK_S
        self._seen = self._identity()
        self._lock = threading.Lock()
        self._warnings = RateLimitedWarnings(logger)
        self.reloads = 0
        """Times new secrets were taken from the file."""

    @property
    def signing(self) -> bytes:
        """The secret every message and signature this process makes is signed with."""
        return self.accepted[0]

    @property
    def accepted(self) -> tuple[bytes, ...]:
        """Every secret a signature may be made with, the signing one first."""
        if self._path is not None and self._clock() >= self._next_check:
            self._check()
        return self._keys

    def _identity(self) -> tuple[int, ...] | None:
        if self._path is None:
            return None
        try:
            info = os.stat(self._path)  # follows a link: a mounted secret swaps its target
        except OSError:
            return None
        return (
            info.st_dev,
            info.st_ino,
            info.st_size,
            info.st_mtime_ns,
            info.st_ctime_ns,
            info.st_mode,
            info.st_uid,
        )

    def _check(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # another thread is at it
        try:
            self._next_check = self._clock() + RELOAD_CHECK_S
            seen = self._identity()
            if seen == self._seen:
                return
            self._seen = seen
            assert self._path is not None
            try:
                secrets = read_secret_file(self._path)
            except ValueError as exc:
                self._warnings.warn(
                    "secret-file",
                    "EC CPU tier: keeping the previous peer secrets: %s",
                    exc,
                )
                return
            keys = tuple(s.encode() for s in secrets)
            if keys != self._keys:
                self._keys = keys
                self.reloads += 1
                logger.info(
                    "EC CPU tier: took %d peer secret(s) from %s",
                    len(keys),
                    self._path,
                )
        finally:
            self._lock.release()
