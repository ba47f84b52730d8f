"""The cross-engine keys of `ec_connector_extra_config`, validated.

Read by every process with the other settings (`ec_core.settings`), so a bad
value stops the engine before any file or socket exists. Nothing here knows
how entries travel between engines; `ec-transfer-nixl` does.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ec_core.peer_secrets import (
    KEY_SECRET,
    KEY_SECRET_FILE,
    MIN_SECRET_CHARS,
    SECRET_ENV,
    PeerSecrets,
    file_error,
    inline_secret_error,
    read_secret_file,
    secrets_from_env,
)

__all__ = [
    "KEY_SECRET",
    "KEY_SECRET_FILE",
    "MIN_SECRET_CHARS",
    "SECRET_ENV",
    "PeerAddress",
    "PeerSettings",
    "parse_peer_settings",
]

KEY_LISTEN = "ec_peer_listen"
KEY_PEERS = "ec_peers"
KEY_LOOKUP_TIMEOUT = "ec_peer_lookup_timeout_s"
KEY_FETCH_TIMEOUT = "ec_peer_fetch_timeout_s"
KEY_LEASE = "ec_peer_lease_s"
KEY_HANDLE_LEASE = "ec_peer_handle_lease_s"

KEYS = frozenset(
    {
        KEY_LISTEN,
        KEY_PEERS,
        KEY_SECRET_FILE,
        KEY_LOOKUP_TIMEOUT,
        KEY_FETCH_TIMEOUT,
        KEY_LEASE,
        KEY_HANDLE_LEASE,
    }
)
DEFAULT_LOOKUP_TIMEOUT_S = 1.0
DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_LEASE_S = 30.0
LEASE_MARGIN_S = 1.0
"""A consumer trusts a READ only if it ended this long before its lease's end."""

PRODUCER_ROLES = frozenset({"ec_producer", "ec_both"})
CONSUMER_ROLES = frozenset({"ec_consumer", "ec_both"})

_ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")


def _invalid(key: str, value: object, reason: str) -> ValueError:
    return ValueError(f"ec_connector_extra_config[{key!r}] = {value!r} is invalid: {reason}")


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """A `HOST:PORT` a producer listens on or a consumer asks."""

    host: str
    """A name, an IPv4 address, or an IPv6 address without its brackets."""
    port: int

    @property
    def is_ipv6(self) -> bool:
        """Whether `host` is an IPv6 literal (ZeroMQ sockets must then enable IPv6)."""
        return ":" in self.host

    @property
    def endpoint(self) -> str:
        """The ZeroMQ TCP endpoint: `tcp://HOST:PORT`, an IPv6 host in brackets."""
        return f"tcp://{self}"

    def __str__(self) -> str:
        """`HOST:PORT`, an IPv6 host in brackets, as `parse` reads it back."""
        return f"[{self.host}]:{self.port}" if self.is_ipv6 else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, key: str, raw: object) -> PeerAddress:
        if not isinstance(raw, str):
            raise _invalid(key, raw, "expected 'HOST:PORT'")
        match = _ADDRESS.match(raw.strip())
        if match is None:
            raise _invalid(key, raw, "expected 'HOST:PORT', e.g. '10.0.0.5:5710'")
        port = int(match.group("port"))
        if not 1 <= port <= 65535:
            raise _invalid(key, raw, "the port must be between 1 and 65535")
        return cls(match.group("host").strip("[]"), port)


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """How this engine serves its entries to other engines and fetches theirs.

    Guarantees: `listen` is set only for a producer role and `peers` only for a
    consumer role; `listen` is the address this engine itself listens on (the
    configured port plus its data-parallel index, at most 65535) and `peers`
    never contains it; at least one secret is present, each of at least
    MIN_SECRET_CHARS characters that encode as UTF-8, none twice, and none came
    from the config itself (peers that share none get nothing); the
    timeouts are finite and positive, and a producer's lease outlasts a
    consumer's fetch deadline by more than LEASE_MARGIN_S, so an entry is never
    released while a fetch within its deadline may still read it, and such a
    fetch's bytes are trusted.
    """

    listen: PeerAddress | None = field(metadata={"key": KEY_LISTEN, "default": "unset"})
    """`HOST:PORT` this engine serves its ready entries on (`ec_producer`, `ec_both`
    only); an IPv6 address in brackets, `[fd00::5]:5710`. Data-parallel engine k
    listens on `PORT + k`; a port past 65535 is refused. The port takes messages
    from whoever reaches it before their signatures are checked: keep it on the
    cluster's own network."""
    peers: tuple[PeerAddress, ...] = field(metadata={"key": KEY_PEERS, "default": "unset"})
    """`["HOST:PORT", ...]` asked on a local miss (`ec_consumer`, `ec_both` only);
    IPv6 in brackets as for `ec_peer_listen`. A peer listed twice is refused; this
    engine's own address is skipped, so every engine of a deployment may get the
    same list."""
    secrets: tuple[str, ...] = field(repr=False)
    """The shared secrets, from `$EC_CPU_TIER_PEER_SECRET` or `ec_peer_secret_file`: the
    first signs every message, any of them verifies one (`ec_core.peer_secrets`)."""
    secret_file: str | None = field(
        default=None, metadata={"key": KEY_SECRET_FILE, "default": f"`${SECRET_ENV}`"}
    )
    """Absolute path of a file holding the shared secret, one secret a line; else the
    secret is read from `$EC_CPU_TIER_PEER_SECRET` (several separated by commas or
    whitespace); not both. Each secret: at least MIN_SECRET_CHARS (8) characters of
    text that encodes as UTF-8 (hex or base64 of random bytes, say), none twice. The
    first signs, any verifies, so a deployment rolls to a new secret without a
    restart (see Security). The file must be a regular file owned by the engine's
    user with no access for group or others (`chmod 600`); it is re-read within
    about a second of a change, and a new content that fails these checks keeps the
    old secrets (one warning a minute). Required with any peer key; peers without a
    common secret get no answer. An inline `ec_peer_secret` is refused: vLLM logs
    the whole `ec_transfer_config` at start-up."""
    lookup_timeout_s: float = field(
        default=DEFAULT_LOOKUP_TIMEOUT_S, metadata={"key": KEY_LOOKUP_TIMEOUT}
    )
    """Seconds a lookup waits for answers before the item is encoded locally; at
    most `ec_peer_fetch_timeout_s`."""
    fetch_timeout_s: float = field(
        default=DEFAULT_FETCH_TIMEOUT_S, metadata={"key": KEY_FETCH_TIMEOUT}
    )
    """Seconds a whole fetch (lookup and READ) may take before the item is encoded
    locally."""
    lease_s: float = field(default=DEFAULT_LEASE_S, metadata={"key": KEY_LEASE})
    """Seconds a producer pins an entry it leased to a consumer, unless released
    earlier; must exceed `ec_peer_fetch_timeout_s` by more than LEASE_MARGIN_S (1 s)."""
    handle_lease_s: float = field(default=0.0, metadata={"key": KEY_HANDLE_LEASE})
    """Seconds a producer pins the ready items of a request-level handle it hands
    out, so a consumer can READ at once (0: handles carry no lease); never longer
    than `ec_peer_lease_s`. Off by default: vLLM drops some handles (parallel
    sampling, streamed responses, several prompts), and their entries then stay
    pinned this long."""

    @property
    def secret(self) -> str:
        """The secret this engine signs with at start-up (the first of `secrets`).

        A running engine with `ec_peer_secret_file` may take others later: whatever
        signs or verifies peer messages asks `ec_core.peer_secrets.PeerSecrets`
        (`keyring`), not this."""
        return self.secrets[0]

    def keyring(self) -> PeerSecrets:
        """A `PeerSecrets` over these secrets that follows `secret_file` when one is set."""
        return PeerSecrets(self.secrets, self.secret_file)


def parse_peer_settings(
    extra: Mapping[str, object], role: str | None, *, dp_index: int = 0
) -> PeerSettings | None:
    """The cross-engine settings, or None when no peer key is set (the layer is off).

    `dp_index` is this engine's data-parallel index (vLLM's `data_parallel_index`).
    Every engine of a data-parallel deployment gets the same config, so engine k
    listens on the port of `ec_peer_listen` plus k (as vLLM's NIXL KV connector
    offsets its side channel), and its handles name that address. An engine never
    asks itself: its own address is left out of `peers`, so one `ec_peers` list
    may name every engine of such a deployment.

    Raises ValueError naming the key (never showing a secret) for anything
    malformed, for a listen address on a consumer-only engine or whose port plus
    `dp_index` passes 65535, for peers on a producer-only engine, for peer keys
    without a secret, for an inline `ec_peer_secret` (always, with or without
    other peer keys: vLLM logs the config), for secrets given both in the
    environment and in a file, for a secret file that is not private to this
    user, and for a secret that is too short, listed twice, or not UTF-8 text.
    """
    if KEY_SECRET in extra:
        raise inline_secret_error()
    secrets, secret_file = _secrets(extra)
    if KEY_LISTEN not in extra and KEY_PEERS not in extra and secrets is None:
        for key in (KEY_LOOKUP_TIMEOUT, KEY_FETCH_TIMEOUT, KEY_LEASE, KEY_HANDLE_LEASE):
            if key in extra:
                raise _invalid(key, extra[key], f"set {KEY_LISTEN} or {KEY_PEERS} to use it")
        return None
    listen = None
    if KEY_LISTEN in extra:
        configured = PeerAddress.parse(KEY_LISTEN, extra[KEY_LISTEN])
        if role is not None and role not in PRODUCER_ROLES:
            raise _invalid(
                KEY_LISTEN,
                extra[KEY_LISTEN],
                f"only ec_producer or ec_both serve; this engine is {role}",
            )
        port = configured.port + dp_index
        if port > 65535:
            raise _invalid(
                KEY_LISTEN,
                extra[KEY_LISTEN],
                f"data-parallel engine {dp_index} would listen on port {configured.port} + "
                f"{dp_index} = {port}, past 65535 (with --data-parallel-size N, engine k "
                "listens on PORT + k: choose a PORT of at most 65536 - N)",
            )
        listen = PeerAddress(configured.host, port)
    peers: tuple[PeerAddress, ...] = ()
    if KEY_PEERS in extra:
        raw = extra[KEY_PEERS]
        if isinstance(raw, str) or not isinstance(raw, (list, tuple)):
            raise _invalid(KEY_PEERS, raw, "expected a list of 'HOST:PORT'")
        peers = tuple(PeerAddress.parse(KEY_PEERS, item) for item in raw)
        if len(set(peers)) != len(peers):
            raise _invalid(KEY_PEERS, raw, "a peer is listed twice")
        # Not refused: with data parallelism every engine gets the same list, and
        # engines that share their entries list all of them, each one itself too.
        peers = tuple(peer for peer in peers if peer != listen)
        if role is not None and role not in CONSUMER_ROLES:
            raise _invalid(
                KEY_PEERS, raw, f"only ec_consumer or ec_both fetch; this engine is {role}"
            )
    if secrets is None:
        raise ValueError(
            f"a shared secret of at least {MIN_SECRET_CHARS} characters is required with "
            f"{KEY_LISTEN} or {KEY_PEERS}: set ${SECRET_ENV} in the engine's environment, or "
            f"name a file holding it (chmod 600) in ec_connector_extra_config[{KEY_SECRET_FILE!r}]"
        )
    lookup = _seconds(extra, KEY_LOOKUP_TIMEOUT, DEFAULT_LOOKUP_TIMEOUT_S)
    fetch = _seconds(extra, KEY_FETCH_TIMEOUT, DEFAULT_FETCH_TIMEOUT_S)
    lease = _seconds(extra, KEY_LEASE, DEFAULT_LEASE_S)
    if lease <= fetch + LEASE_MARGIN_S:
        raise _invalid(
            KEY_LEASE,
            extra.get(KEY_LEASE, lease),
            f"must exceed {KEY_FETCH_TIMEOUT} ({fetch:g} s) by more than {LEASE_MARGIN_S:g} s: "
            "a producer would release entries a fetch may still be reading (a consumer "
            f"trusts a READ only if it ended {LEASE_MARGIN_S:g} s before its lease's end)",
        )
    if lookup > fetch:
        raise _invalid(
            KEY_LOOKUP_TIMEOUT,
            extra.get(KEY_LOOKUP_TIMEOUT, lookup),
            f"must not exceed {KEY_FETCH_TIMEOUT}",
        )
    handle_lease = _seconds(extra, KEY_HANDLE_LEASE, 0.0, allow_zero=True)
    if handle_lease > lease:
        raise _invalid(
            KEY_HANDLE_LEASE, extra[KEY_HANDLE_LEASE], f"must not exceed {KEY_LEASE} ({lease:g} s)"
        )
    return PeerSettings(listen, peers, secrets, secret_file, lookup, fetch, lease, handle_lease)


def _secrets(extra: Mapping[str, object]) -> tuple[tuple[str, ...] | None, str | None]:
    """The secrets and the file they came from (None: from the environment); `(None,
    None)` when neither gives any. An empty variable is no secret (a template's
    default, an unset variable passed through): alone it must not turn the layer on."""
    env = os.environ.get(SECRET_ENV) or None
    if KEY_SECRET_FILE not in extra:
        return (secrets_from_env(env) if env is not None else None), None
    raw = extra[KEY_SECRET_FILE]
    if not isinstance(raw, str) or not raw.strip():
        raise _invalid(KEY_SECRET_FILE, raw, "expected the absolute path of a file")
    if env is not None:
        # Refused rather than ranked: a forgotten variable would otherwise silently win
        # (or lose), and engines of one deployment could sign with different secrets.
        raise file_error(
            raw,
            f"${SECRET_ENV} is set too; give the secret one way only (unset the variable, "
            "or drop this key)",
        )
    return read_secret_file(raw), raw


def _seconds(
    extra: Mapping[str, object], key: str, default: float, *, allow_zero: bool = False
) -> float:
    raw = extra.get(key, default)
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise _invalid(key, raw, "expected a number of seconds")
    try:
        seconds = float(raw)
    except (ValueError, OverflowError):
        raise _invalid(key, raw, "expected a number of seconds") from None
    if allow_zero and seconds == 0:
        return 0.0
    if not math.isfinite(seconds) or seconds <= 0:
        what = "0 or a finite, positive" if allow_zero else "a finite, positive"
        raise _invalid(key, raw, f"expected {what} number of seconds")
    return seconds
