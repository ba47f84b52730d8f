"""The wire format, its authentication, the leases and the span pairing (no NIXL, no sockets)."""

from __future__ import annotations

import pytest

from ec_transfer_nixl.agent import paired_spans
from ec_transfer_nixl.leases import Leases
from ec_transfer_nixl.wire import (
    FRESH_S,
    MAGIC,
    Lookup,
    Release,
    Reply,
    WireError,
    fingerprint,
    handle_signature,
    open_frame,
    seal,
)

SECRET = b"0123456789abcdef"


def _lookup(sent_at: float = 1000.0) -> Lookup:
    return Lookup(nonce=7, sent_at=sent_at, fingerprint="fp", items=[("img", 8, 128)])


def test_messages_round_trip_when_signed_with_the_secret() -> None:
    reply = Reply(
        nonce=7,
        sent_at=1000.0,
        status="ok",
        agent="a",
        agent_metadata=b"\x00\x01",
        lease=3,
        lease_s=30.0,
        results=[("img", "ok", [(4096, 512)])],
    )
    claim = Lookup(
        nonce=8, sent_at=1000.0, fingerprint="fp", items=[("img", 8, 128)], known_agent="a", claim=3
    )
    messages = (_lookup(), claim, Release(nonce=1, sent_at=1000.0, lease=3, keys=["img"]), reply)
    for message in messages:
        frame = seal(message, SECRET)
        assert isinstance(frame, bytes) and frame.startswith(MAGIC)
        assert open_frame(frame, SECRET, now=1000.0) == message


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda f: f[:-32] + b"\x00" * 32, "not signed"),
        (lambda f: f[:-33] + bytes([f[-33] ^ 1]) + f[-32:], "not signed"),
        (lambda f: b"ECCPUTIER/1" + f[len(MAGIC) :], "wire version"),
        (lambda f: f[:20], "too short"),
    ],
)
def test_tampered_or_foreign_messages_are_refused(mutate: object, needle: str) -> None:
    frame = seal(_lookup(), SECRET)
    with pytest.raises(WireError, match=needle):
        open_frame(mutate(frame), SECRET, now=1000.0)  # type: ignore[operator]


def test_another_secret_or_a_stale_message_is_refused() -> None:
    with pytest.raises(WireError, match="not signed"):
        open_frame(seal(_lookup(), b"another secret!!"), SECRET, now=1000.0)
    with pytest.raises(WireError, match="stale"):
        open_frame(seal(_lookup(), SECRET), SECRET, now=1000.0 + FRESH_S + 1)
    assert MAGIC.startswith(b"ECCPUTIER/")


def test_a_signed_but_malformed_payload_is_refused() -> None:
    import hashlib
    import hmac

    payload = b"\x93\xa3bad"
    mac = hmac.new(SECRET, MAGIC + payload, hashlib.sha256).digest()
    with pytest.raises(WireError, match="malformed"):
        open_frame(MAGIC + payload + mac, SECRET)


def test_a_handle_signature_covers_every_field() -> None:
    fields = {
        "peer": "h:1",
        "fingerprint": "fp",
        "items": {"img": [8, 128]},
        "id": 3,
        "agent": "a",
        "spans": {"img": [[4096, 4096]]},
        "issued": 1000.5,
        "ttl": 10.0,
    }
    signed = handle_signature(SECRET, fields)
    assert signed == handle_signature(SECRET, dict(reversed(fields.items())))
    assert signed != handle_signature(b"another secret!!", fields)
    for key, other in (
        ("peer", "h:2"),
        ("items", {"img": [9, 128]}),
        ("id", 4),
        ("agent", "b"),
        ("spans", {"img": [[8192, 4096]]}),
        ("issued", 1000.6),
        ("ttl", 11.0),
    ):
        assert handle_signature(SECRET, {**fields, key: other}) != signed


def test_fingerprints_differ_in_every_field_that_matters() -> None:
    base = {"model": "m", "revision": None, "dtype": "f32", "embed_width": 128, "block_bytes": 512}
    seen = {fingerprint(**base)}  # type: ignore[arg-type]
    for key, other in (
        ("model", "n"),
        ("revision", "r"),
        ("dtype", "bf16"),
        ("embed_width", 64),
        ("block_bytes", 256),
    ):
        seen.add(fingerprint(**{**base, key: other}))  # type: ignore[arg-type]
    assert len(seen) == 6


def test_leases_release_on_give_back_or_expiry_and_only_once() -> None:
    released: list[str] = []
    clock = [0.0]
    leases = Leases(released.extend, clock=lambda: clock[0])
    assert leases.grant({}, 10) == 0
    first = leases.grant({"a": 10, "b": 20}, 10)
    second = leases.grant({"c": 30}, 20)
    assert leases.pins == 3
    assert leases.give_back(first, ["a", "a", "zzz"]) == [("a", 10)]
    assert leases.give_back(first, ["a"]) == [], "a key is released once"
    assert leases.give_back(999, ["b"]) == []
    clock[0] = 10.0
    assert leases.expire() == 1 and released == ["a", "b"]
    assert len(leases) == 1
    leases.release_all()
    assert released == ["a", "b", "c"] and len(leases) == 0 and second


def test_a_handle_lease_is_claimed_once_and_only_while_it_lasts() -> None:
    released: list[str] = []
    clock = [0.0]
    leases = Leases(released.extend, clock=lambda: clock[0])
    spans = {"a": [(100, 8)], "b": [(200, 8)]}
    handle = leases.grant({"a": 8, "b": 8}, 5, claimable=spans)
    assert leases.active == 0, "an unclaimed handle lease has no READ running"
    assert leases.claim(999, ["a"], 30) == {}
    assert leases.claim(handle, ["a", "zzz"], 30) == {"a": [(100, 8)]}
    assert released == ["b"], "the keys not claimed go at once"
    assert leases.active == 1
    assert leases.claim(handle, ["a"], 30) == {}, "claimed once only"
    clock[0] = 10.0
    assert leases.expire() == 0, "a claim extends the lease"
    assert leases.give_back(handle, ["a"]) == [("a", 8)]
    assert released == ["b", "a"] and leases.active == 0 and len(leases) == 0
    late = leases.grant({"c": 8}, 5, claimable={"c": [(300, 8)]})
    clock[0] = 20.0
    assert leases.expire() == 1 and leases.claim(late, ["c"], 30) == {}
    assert released == ["b", "a", "c"] and leases.active == 0


def test_spans_are_paired_into_equal_pieces_whatever_the_runs() -> None:
    local = [(1000, 6), (2000, 4)]
    remote = [(50, 3), (60, 5), (90, 2)]
    pieces = list(paired_spans(local, remote))
    assert pieces == [
        ((1000, 3), (50, 3)),
        ((1003, 3), (60, 3)),
        ((2000, 2), (63, 2)),
        ((2002, 2), (90, 2)),
    ]
    assert list(paired_spans([(0, 8)], [(100, 8)])) == [((0, 8), (100, 8))]
    with pytest.raises(ValueError, match="different numbers of bytes"):
        list(paired_spans([(0, 8)], [(0, 7)]))
