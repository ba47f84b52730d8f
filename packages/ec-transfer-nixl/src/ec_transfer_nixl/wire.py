"""What peers say to each other, and how a message proves it knows the shared secret.

Used by the producer's server thread, the consumer's fetcher thread and the
scheduler thread (handles), all in the scheduler process. Every message is
one ZMQ frame:

    MAGIC + payload + mac     mac = HMAC-SHA256(secret, MAGIC + payload), 32 bytes

`secret` is the sender's signing secret; a receiver accepts a mac made with any
of its secrets (`ec_core.peer_secrets`: the first signs, any verifies), which is
how a deployment rolls to a new secret without stopping.

`payload` is a msgspec-msgpack `Lookup`, `Release` or `Reply`, every field
always sent (a field's default only spares its writer the common value). A message whose
mac does not verify, whose magic (wire version) differs, or whose `sent_at`
is further than FRESH_S from the receiver's clock is dropped unanswered:
without the secret a peer gets no answer, no pin and no address to read.
One frame per message, not several: every ZMQ send or receive releases the GIL, and each
time it is taken back costs a wait for whatever other thread holds it.

A lookup either asks for new leases or *claims* pre-granted ones. A
request-level handle (`handle_signature`) carries a pre-granted lease: the
spans of the producer's ready entries, pinned when the handle was made, and
an HMAC over all of it, so a consumer starts its READ at once and confirms the
lease with a claim (a `Lookup` whose `claims` names, per item, the handle
lease it is claimed under) while the READ runs. Every `Reply` says, per
result, which lease holds the item for the consumer (`Reply.leases`), and a
`Release` gives back any number of leases' keys in one message.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import time
from typing import Any

import msgspec

from ec_core.peer_secrets import signed_by_any

WIRE_VERSION = 3
MAGIC = f"ECCPUTIER/{WIRE_VERSION}".encode()
MAC_BYTES = 32
FRESH_S = 120.0
"""How far a message's `sent_at` may be from the receiver's clock."""

OK = "ok"
MISSING = "missing"
SAVING = "saving"
SHAPE = "shape"
INCOMPATIBLE = "incompatible"
LAPSED = "lapsed"
"""A claimed handle lease no longer holds the item (expired, claimed before, or
unknown): the consumer asks again with an ordinary lookup."""


class Lookup(msgspec.Struct, array_like=True, tag="lookup"):
    """Consumer → producer: lease these items, of these shapes, for one fetch; or,
    with `claims`, claim the handle leases that already pin them.

    A claim takes no new lease: the producer confirms, per item, that the handle
    lease it is claimed under still pins it (OK, the same spans), and keeps it
    pinned for `lease_s` more; a lease can be claimed once. A claim whose `claims`
    do not name one lease per item claims nothing (every item LAPSED).
    """

    nonce: int
    sent_at: float
    fingerprint: str
    items: list[tuple[str, int, int]]
    """`(key, rows, cols)` per item; `cols` 0 (`ec_scheduler.remote.ANY_WIDTH`): of
    whatever width the producer holds it in (a consumer that measured no encoder
    output width for the item's modality)."""
    known_agent: str = ""
    """The producer's NIXL agent this consumer knows already (""; none): its metadata
    is then not sent again."""
    claims: list[int] = []
    """Empty: a lookup. Else a claim: per item (in the order of `items`), the handle
    lease it is claimed under."""


class Release(msgspec.Struct, array_like=True, tag="release"):
    """Consumer → producer: per lease, the keys it will not read, or whose READ is over
    (`read`: it completed, so the bytes were served)."""

    nonce: int
    sent_at: float
    leases: list[tuple[int, list[str]]]
    """`(lease, keys)` per lease given back."""
    read: bool = False


class Reply(msgspec.Struct, array_like=True, tag="reply"):
    """Producer → consumer: per item a status and, when `ok`, the addresses to read and
    the lease that pins it.

    `status` is INCOMPATIBLE for the whole message when the fingerprints
    differ (then `results` is empty). A leased item stays pinned on the
    producer until the consumer's Release or `lease_s` seconds. The agent's
    metadata is empty when the lookup named this agent as known. A consumer
    drops a reply whose `leases` do not name one lease per result.
    """

    nonce: int
    sent_at: float
    status: str
    agent: str
    agent_metadata: bytes
    lease_s: float
    results: list[tuple[str, str, list[tuple[int, int]]]]
    """`(key, status, [(address, nbytes), ...])` per item asked."""
    leases: list[int]
    """Per result, the lease that holds the item for this consumer (0: none)."""
    shapes: list[tuple[int, int]]
    """The answer to a lookup: per result, the `(rows, cols)` the producer holds the
    item in ((0, 0): none), so a consumer that asked for any width learns it, and
    one that was answered SHAPE can say what was on offer. Empty in the answer to a
    claim (the handle named the shapes)."""


Message = Lookup | Release | Reply
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_encode = msgspec.msgpack.Encoder().encode
_digest = hmac.digest
_HEAD = len(MAGIC)


class WireError(ValueError):
    """A message that must be dropped: wrong version, mac, age or shape."""


def seal(message: Message, secret: bytes) -> bytes:
    """The frame that carries `message`."""
    body = MAGIC + _encode(message)
    return body + _digest(secret, body, "sha256")


def open_frame(frame: bytes, accepted: tuple[bytes, ...], now: float | None = None) -> Message:
    """The message in `frame`, or WireError when it must be dropped unanswered.

    `accepted`: the secrets a mac may be made with, the signing one first (checked
    in order, so a frame from a peer that signs as this one does costs one HMAC)."""
    if not frame.startswith(MAGIC):
        raise WireError(f"wire version {frame[:32]!r}, this peer speaks {MAGIC!r}")
    if len(frame) < _HEAD + MAC_BYTES:
        raise WireError(f"a frame of {len(frame)} bytes is too short")
    body = frame[:-MAC_BYTES]
    if not signed_by_any(frame[-MAC_BYTES:], body, accepted):
        raise WireError("the message is not signed with any of this engine's peer secrets")
    try:
        message: Message = _decoder.decode(body[_HEAD:])
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed payload: {exc}") from None
    clock = time.time() if now is None else now
    if not abs(clock - message.sent_at) <= FRESH_S:  # NaN too: it would never go stale
        raise WireError(f"stale message (sent {clock - message.sent_at:.0f} s ago)")
    return message


class Replays:
    """The macs of the authentic frames a receiver took while their `sent_at` is fresh:
    a frame seen before is a replay (a signed frame travels in clear, and stays fresh
    for FRESH_S).

    A mac is forgotten only once its frame is no longer fresh, so a replay is always
    refused. Forgetting is amortised O(1) per frame, in arrival order (no periodic
    sweep); a frame stays at most until the frames taken before it have gone, so
    memory holds the authentic frames of the last 3 x FRESH_S at most.
    """

    def __init__(self) -> None:
        self._until: dict[bytes, float] = {}
        self._order: collections.deque[tuple[float, bytes]] = collections.deque()

    def __len__(self) -> int:
        return len(self._until)

    def first(self, frame: bytes, message: Message, now: float) -> bool:
        """False if `frame` (already opened: `message`) was taken before."""
        order, until = self._order, self._until
        while order and order[0][0] < now:
            del until[order.popleft()[1]]
        mac = frame[-MAC_BYTES:]
        if mac in until:
            return False
        fresh_until = message.sent_at + FRESH_S
        until[mac] = fresh_until
        order.append((fresh_until, mac))
        return True


def handle_signed(accepted: tuple[bytes, ...], fields: dict[str, Any], sig: str) -> bool:
    """Whether `sig` is `handle_signature` of `fields` under one of the `accepted` secrets."""
    return any(hmac.compare_digest(handle_signature(s, fields), sig) for s in accepted)


def handle_signature(secret: bytes, fields: dict[str, Any]) -> str:
    """The HMAC (hex) that makes a handle's pre-granted lease unforgeable: over every
    field a consumer acts on (peer, fingerprint, lease, agent, items, spans, time)."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return _digest(secret, MAGIC + text.encode(), "sha256").hex()


def fingerprint(
    *,
    model: str,
    revision: str | None,
    dtype: str,
    embed_width: int,
    block_bytes: int,
    overrides: str = "",
) -> str:
    """What must match for an entry of one engine to be valid in another.

    `overrides` is the engine's `hf_overrides` in canonical text (`overrides_text`):
    they can change the model's architecture, and with it the width of its encoder
    outputs, which a consumer that measured none takes from its peer's answer.
    """
    identity: dict[str, Any] = {
        "model": model,
        "revision": revision or "",
        "dtype": dtype,
        "embed_width": embed_width,
        "block_bytes": block_bytes,
        "overrides": overrides,
        "wire": WIRE_VERSION,
    }
    text = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def overrides_text(overrides: object) -> str:
    """`hf_overrides` as text that is equal for equal overrides: a mapping as sorted JSON,
    a callable by its qualified name (what it does cannot be compared), nothing as ""."""
    if not overrides:
        return ""
    if callable(overrides):
        module = getattr(overrides, "__module__", "")
        return f"callable:{module}.{getattr(overrides, '__qualname__', '')}"
    return json.dumps(overrides, sort_keys=True, default=str)
