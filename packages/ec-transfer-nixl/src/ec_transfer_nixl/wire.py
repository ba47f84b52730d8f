"""What peers say to each other, and how a message proves it knows the shared secret.

Used by the producer's server thread and the consumer's fetcher thread (both
in the scheduler process). Every message is three ZMQ frames:

    [MAGIC, payload, mac]     mac = HMAC-SHA256(secret, MAGIC + payload)

`payload` is a msgspec-msgpack `Lookup`, `Release` or `Reply`. A message whose
mac does not verify, whose magic (wire version) differs, or whose `sent_at`
is further than FRESH_S from the receiver's clock is dropped unanswered:
without the secret a peer gets no answer, no pin and no address to read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any

import msgspec

WIRE_VERSION = 1
MAGIC = f"ECCPUTIER/{WIRE_VERSION}".encode()
FRESH_S = 120.0
"""How far a message's `sent_at` may be from the receiver's clock."""

OK = "ok"
MISSING = "missing"
SAVING = "saving"
SHAPE = "shape"
INCOMPATIBLE = "incompatible"


class Lookup(msgspec.Struct, array_like=True, tag="lookup"):
    """Consumer → producer: lease these items, of these shapes, for one fetch."""

    nonce: int
    sent_at: float
    fingerprint: str
    items: list[tuple[str, int, int]]
    """`(key, rows, cols)` per item."""


class Release(msgspec.Struct, array_like=True, tag="release"):
    """Consumer → producer: the keys of a lease it will not read, or whose READ is over
    (`read`: it completed, so the bytes were served)."""

    nonce: int
    sent_at: float
    lease: int
    keys: list[str]
    read: bool = False


class Reply(msgspec.Struct, array_like=True, tag="reply"):
    """Producer → consumer: per item a status and, when `ok`, the addresses to read.

    `status` is INCOMPATIBLE for the whole message when the fingerprints
    differ (then `results` is empty). A leased item stays pinned on the
    producer until the consumer's Release or `lease_s` seconds.
    """

    nonce: int
    sent_at: float
    status: str
    agent: str
    agent_metadata: bytes
    lease: int
    lease_s: float
    results: list[tuple[str, str, list[tuple[int, int]]]]
    """`(key, status, [(address, nbytes), ...])` per item asked."""


Message = Lookup | Release | Reply
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


class WireError(ValueError):
    """A message that must be dropped: wrong version, mac, age or shape."""


def seal(message: Message, secret: bytes) -> list[bytes]:
    """The frames that carry `message`."""
    payload = _encoder.encode(message)
    return [MAGIC, payload, hmac.new(secret, MAGIC + payload, hashlib.sha256).digest()]


def open_frames(frames: list[bytes], secret: bytes, now: float | None = None) -> Message:
    """The message in `frames`, or WireError when it must be dropped unanswered."""
    if len(frames) != 3:
        raise WireError(f"expected 3 frames, got {len(frames)}")
    magic, payload, mac = frames
    if magic != MAGIC:
        raise WireError(f"wire version {magic[:32]!r}, this peer speaks {MAGIC!r}")
    expected = hmac.new(secret, MAGIC + payload, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise WireError("the message is not signed with this engine's ec_peer_secret")
    try:
        message: Message = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed payload: {exc}") from None
    clock = time.time() if now is None else now
    if abs(clock - message.sent_at) > FRESH_S:
        raise WireError(f"stale message (sent {clock - message.sent_at:.0f} s ago)")
    return message


def fingerprint(
    *, model: str, revision: str | None, dtype: str, embed_width: int, block_bytes: int
) -> str:
    """What must match for an entry of one engine to be valid in another."""
    identity: dict[str, Any] = {
        "model": model,
        "revision": revision or "",
        "dtype": dtype,
        "embed_width": embed_width,
        "block_bytes": block_bytes,
        "wire": WIRE_VERSION,
    }
    text = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
