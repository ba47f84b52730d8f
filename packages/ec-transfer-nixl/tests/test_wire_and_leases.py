"""The wire format, its authentication, the leases, the producer's answers to claims and
the span pairing (no NIXL, no sockets)."""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from ec_core.peer_secrets import PeerSecrets
from ec_core.peer_settings import PeerAddress
from ec_core.scheduler_process.allocator import BlockAllocator
from ec_scheduler.remote import LocalEntries
from ec_transfer_nixl.agent import paired_spans
from ec_transfer_nixl.counters import PeerCounters
from ec_transfer_nixl.leases import Leases
from ec_transfer_nixl.server import PeerServer
from ec_transfer_nixl.wire import (
    FRESH_S,
    LAPSED,
    MAGIC,
    MISSING,
    OK,
    Lookup,
    Release,
    Reply,
    WireError,
    fingerprint,
    handle_signature,
    open_frame,
    overrides_text,
    seal,
)
from ectools.ports import free_port

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
        lease_s=30.0,
        results=[("img", "ok", [(4096, 512)])],
        leases=[3],
        shapes=[(8, 128)],
    )
    claim = Lookup(
        nonce=8,
        sent_at=1000.0,
        fingerprint="fp",
        items=[("img", 8, 128)],
        known_agent="a",
        claims=[3],
    )
    messages = (_lookup(), claim, Release(nonce=1, sent_at=1000.0, leases=[(3, ["img"])]), reply)
    for message in messages:
        frame = seal(message, SECRET)
        assert isinstance(frame, bytes) and frame.startswith(MAGIC)
        assert open_frame(frame, (SECRET,), now=1000.0) == message


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
        open_frame(mutate(frame), (SECRET,), now=1000.0)  # type: ignore[operator]


def test_another_secret_or_a_stale_message_is_refused() -> None:
    with pytest.raises(WireError, match="not signed"):
        open_frame(seal(_lookup(), b"another secret!!"), (SECRET,), now=1000.0)
    with pytest.raises(WireError, match="stale"):
        open_frame(seal(_lookup(), SECRET), (SECRET,), now=1000.0 + FRESH_S + 1)
    assert MAGIC.startswith(b"ECCPUTIER/")


def test_a_message_stamped_with_no_time_is_refused() -> None:
    """A signed message whose `sent_at` is NaN (a buggy peer) is no closer than FRESH_S
    to any clock: taken, it would never be stale, and the receiver's replay table,
    which forgets in arrival order, would keep every later frame for good."""
    for sent_at in (math.nan, math.inf, -math.inf):
        with pytest.raises(WireError, match="stale"):
            open_frame(seal(_lookup(sent_at=sent_at), SECRET), (SECRET,), now=1000.0)


def test_a_signed_but_malformed_payload_is_refused() -> None:
    payload = b"\x93\xa3bad"
    mac = hmac.new(SECRET, MAGIC + payload, hashlib.sha256).digest()
    with pytest.raises(WireError, match="malformed"):
        open_frame(MAGIC + payload + mac, (SECRET,))


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
        ("overrides", overrides_text({"vision_config": {"deepstack_visual_indexes": [1]}})),
    ):
        seen.add(fingerprint(**{**base, key: other}))  # type: ignore[arg-type]
    assert len(seen) == 7


def test_equal_overrides_read_alike_and_none_is_no_override() -> None:
    assert overrides_text(None) == overrides_text({}) == ""
    assert overrides_text({"a": 1, "b": {"c": 2}}) == overrides_text({"b": {"c": 2}, "a": 1})
    assert overrides_text({"a": 1}) != overrides_text({"a": 2})
    assert overrides_text(test_equal_overrides_read_alike_and_none_is_no_override).startswith(
        "callable:"
    )


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
    assert leases.grant({"d": 8}, 10) == 0, "nothing is granted after release_all"
    assert released == ["a", "b", "c", "d"] and len(leases) == 0, "its pin went at once"


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


def test_several_handle_leases_are_claimed_and_given_back_together() -> None:
    released: list[str] = []
    clock = [0.0]
    leases = Leases(released.extend, clock=lambda: clock[0])
    first = leases.grant({"a": 8, "b": 8}, 5, claimable={"a": [(100, 8)], "b": [(200, 8)]})
    second = leases.grant({"c": 8}, 5, claimable={"c": [(300, 8)]})
    gone = leases.grant({"d": 8}, 1, claimable={"d": [(400, 8)]})
    clock[0] = 2.0
    assert leases.expire() == 1 and released == ["d"], "one lapsed among several"
    claimed = leases.claim_many({first: ["a"], second: ["c"], gone: ["d"], 999: ["e"]}, 30)
    assert claimed == {first: {"a": [(100, 8)]}, second: {"c": [(300, 8)]}}
    assert released == ["d", "b"], "the keys not claimed go at once"
    assert leases.active == 2
    assert leases.claim_many({first: ["a"], second: ["c"]}, 30) == {}, "claimable once"
    back = leases.give_back_many([(first, ["a", "zzz"]), (999, ["x"]), (second, ["c"])])
    assert back == [[("a", 8)], [], [("c", 8)]]
    assert released == ["d", "b", "a", "c"] and leases.active == 0 and len(leases) == 0


BLOCK, ITEMSIZE, COLS = 64, 4, 16  # one row = one block


def _ready_entries(keys: tuple[str, ...]) -> tuple[BlockAllocator, LocalEntries]:
    """An allocator holding `keys` ready, one row each, and the producer's view of it."""
    allocator = BlockAllocator(16)
    for key in keys:
        allocator.alloc(key, 1, (1, COLS))
        allocator.mark_ready(key)
    local = LocalEntries(
        allocator, threading.RLock(), allocator.unpin, lambda key: False, lambda r, c: r
    )
    return allocator, local


def _producer(*keys: str) -> tuple[PeerServer, BlockAllocator]:
    """A producer's server (not started) over an allocator holding `keys` ready, one row each."""
    allocator, local = _ready_entries(keys)
    server = PeerServer(
        context=None,  # type: ignore[arg-type]
        listen=PeerAddress("127.0.0.1", 1),
        keys=PeerSecrets((SECRET.decode(),)),
        fingerprint="fp",
        local=local,
        make_agent=None,  # type: ignore[arg-type]
        spans=lambda runs, nbytes: [(first * BLOCK, n * BLOCK) for first, n in runs],
        itemsize=ITEMSIZE,
        lease_s=30.0,
        handle_lease_s=10.0,
        counters=PeerCounters(),
    )
    server.agent = SimpleNamespace(name="producer", metadata=b"md")  # type: ignore[assignment]
    return server, allocator


def _claim(items: list[str], claims: list[int]) -> Lookup:
    return Lookup(
        nonce=1,
        sent_at=1000.0,
        fingerprint="fp",
        items=[(key, 1, COLS) for key in items],
        known_agent="producer",
        claims=claims,
    )


def test_a_producer_answers_a_claim_of_several_leases_each_under_its_own() -> None:
    """One claim names three handles' leases, one of them lapsed (claimed before): the
    others are confirmed at their spans, each under its own lease; a second claim of
    them finds them lapsed; one Release gives all of them back."""
    server, allocator = _producer("a", "b", "c")
    grants = [server.grant_handle({key: (1, COLS)}) for key in ("a", "b", "c")]
    (la, spans_a), (lb, _), (lc, spans_c) = grants
    assert allocator.num_held_entries == 3, "pinned from the handle's making"
    (early,) = server._answer_all([_claim(["b"], [lb])])
    assert early.results[0][1] == OK and early.leases == [lb]
    (reply,) = server._answer_all([_claim(["a", "b", "c"], [la, lb, lc])])
    assert reply.status == OK
    assert reply.results == [("a", OK, spans_a["a"]), ("b", LAPSED, []), ("c", OK, spans_c["c"])]
    assert reply.leases == [la, 0, lc]
    (again,) = server._answer_all([_claim(["a", "c"], [la, lc])])
    assert [status for _, status, _ in again.results] == [LAPSED, LAPSED] and again.leases == [0, 0]
    release = Release(2, 1000.0, [(la, ["a"]), (lb, ["b"]), (lc, ["c"])], read=True)
    server._give_back([release])
    assert not allocator.has_held_entries()
    assert server.counters.bytes_served == 3 * COLS * ITEMSIZE
    assert server.counters.lookups_served == 3


def test_the_policy_hears_of_a_peers_reads_not_of_a_handle_granted_ahead() -> None:
    """A handle pins a finished request's items before anyone asks for them: no request
    to the policy. A claim of it, and a lookup's lease, are reads: one request each."""
    server, allocator = _producer("a", "b", "c")
    told: list[str] = []
    allocator.note_request = told.append  # type: ignore[method-assign]
    lease, _ = server.grant_handle({"a": (1, COLS), "b": (1, COLS)})
    assert lease and told == []
    (claimed,) = server._answer_all([_claim(["a"], [lease])])
    assert claimed.results[0][1] == OK and told == ["a"]
    (looked_up,) = server._answer_all([_claim(["c", "zzz"], [])])  # a lookup: no claims
    assert [status for _, status, _ in looked_up.results] == [OK, MISSING]
    assert told == ["a", "c"]


def test_a_claim_that_names_no_lease_per_item_claims_nothing() -> None:
    """Claims that do not match the items claim nothing (and pin nothing)."""
    server, allocator = _producer("a", "b")
    lease, _ = server.grant_handle({"a": (1, COLS), "b": (1, COLS)})
    (bad,) = server._answer_all([_claim(["a", "b"], [lease])])
    assert [status for _, status, _ in bad.results] == [LAPSED, LAPSED] and bad.leases == [0, 0]
    assert allocator.num_held_entries == 2, "a malformed claim claims nothing"


def test_a_read_that_fails_in_nixl_reads_as_err_and_never_raises() -> None:
    """NIXL's check_xfer_state raises (e.g. nixlRemoteDisconnectError when the producer
    dies during a READ over TCP) instead of returning "ERR": RegionAgent.state must
    still say "ERR", else the exception ends the fetcher thread and every later fetch
    is never done (its requests wait forever)."""
    from ec_transfer_nixl.agent import RegionAgent

    class DisconnectError(Exception):
        pass

    def check_xfer_state(handle: object) -> str:
        raise DisconnectError("NIXL_ERR_REMOTE_DISCONNECT")

    agent = RegionAgent.__new__(RegionAgent)
    agent._agent = SimpleNamespace(check_xfer_state=check_xfer_state)  # type: ignore[attr-defined]
    assert agent.state(object()) == "ERR"


WAIT_S = 60.0
"""Upper bound for an answer that normally comes within milliseconds (CI slack)."""
NO_ANSWER_MS = 500
"""How long a test listens to show that no answer comes (after the server has
handled the message, so a late answer would already be on its way)."""


def _answer(dealer: Any) -> bytes:
    """The next frame, waiting up to WAIT_S: a loaded machine must not fail the test."""
    assert dealer.poll(int(WAIT_S * 1000)), "no answer"
    frame: bytes = dealer.recv()
    return frame


def _serving(allocator_keys: tuple[str, ...] = ("a",)) -> tuple[Any, Any, BlockAllocator, Any]:
    """A started producer's server over a real ROUTER socket, with a stand-in NIXL agent
    (`agent.fail` makes its next `notifications` raise), and a DEALER connected to it."""
    port = free_port()
    allocator, local = _ready_entries(allocator_keys)
    agent = SimpleNamespace(name="producer", metadata=b"md", fail=False)

    def notifications() -> dict[str, list[bytes]]:
        if agent.fail:
            raise RuntimeError("an unexpected error in the server thread")
        return {}

    agent.notifications = notifications
    agent.close = lambda: None
    context = zmq.Context()
    server = PeerServer(
        context=context,
        listen=PeerAddress("127.0.0.1", port),
        keys=PeerSecrets((SECRET.decode(),)),
        fingerprint="fp",
        local=local,
        make_agent=lambda: agent,  # type: ignore[arg-type,return-value]
        spans=lambda runs, nbytes: [(first * BLOCK, n * BLOCK) for first, n in runs],
        itemsize=ITEMSIZE,
        lease_s=30.0,
        counters=PeerCounters(),
    )
    server.start()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return server, agent, allocator, dealer


def test_a_server_that_stops_on_an_error_keeps_the_pins_of_leases_consumers_read_under() -> None:
    """A consumer that got its Reply READs under the lease until it ends (it trusts
    the bytes until then); the server thread ending on an unexpected error must not
    hand those pins back early, else the entry is evicted and overwritten mid-READ."""
    server, agent, allocator, dealer = _serving()
    waiting = threading.Event()

    class Stop(threading.Event):
        """The thread's stop event; a `wait` on it is the thread holding the pins
        until the leases expire (or the engine stops), after the error."""

        def wait(self, timeout: float | None = None) -> bool:
            waiting.set()
            return super().wait(timeout)

    server._stop = Stop()
    try:
        lookup = Lookup(nonce=1, sent_at=time.time(), fingerprint="fp", items=[("a", 1, COLS)])
        dealer.send(seal(lookup, SECRET))
        reply = open_frame(_answer(dealer), (SECRET,))
        assert isinstance(reply, Reply) and reply.results[0][1] == OK and reply.leases[0]
        assert allocator.num_held_entries == 1
        agent.fail = True
        # Past the error's clean-up: waiting for the lease, or (were the pins handed
        # back early) ended. A fixed sleep would let a slow thread pass unchecked.
        deadline = time.monotonic() + WAIT_S
        while not (waiting.is_set() or not server._thread.is_alive()):
            assert time.monotonic() < deadline, "the server thread did not stop on the error"
            time.sleep(0.01)
        assert server._stopped, "the server thread stopped on the error"
        assert allocator.num_held_entries == 1, "the lease's 30 s are not over: still pinned"
        lookup2 = Lookup(nonce=2, sent_at=time.time(), fingerprint="fp", items=[("a", 1, COLS)])
        dealer.send(seal(lookup2, SECRET))
        assert not dealer.poll(NO_ANSWER_MS), "a stopped server answers nothing"
    finally:
        assert server.stop()
        dealer.close(0)
    assert not allocator.has_held_entries(), "stopping the server gives the pins back"


def test_a_handle_granted_while_the_server_stops_pins_nothing() -> None:
    """`grant_handle` runs on the scheduler thread: the server may stop (and release
    every lease) between its check and the lease being recorded. Nothing would expire
    a lease recorded after that, so its pins must go at once and no handle is made."""
    server, _, allocator, dealer = _serving()
    take_pins = server._local.lease_many

    def pins_then_server_stops(items: Any, **flags: Any) -> Any:
        out = take_pins(items, **flags)
        assert allocator.num_held_entries == 1
        assert server.stop()  # its thread ends with release_all
        return out

    server._local.lease_many = pins_then_server_stops
    try:
        assert server.grant_handle({"a": (1, COLS)}) == (0, {})
        assert not allocator.has_held_entries(), "the pin taken for the handle went at once"
        assert len(server.leases) == 0
    finally:
        server.stop()
        dealer.close(0)


def test_a_replayed_lookup_gets_no_answer_and_no_pin() -> None:
    """Frames travel in clear over TCP: whoever captures a consumer's signed Lookup
    must not get a lease, a pin and the addresses by sending it again (its `sent_at`
    stays fresh for FRESH_S). The same frame is answered once."""
    server, _, allocator, dealer = _serving()
    try:
        frame = seal(
            Lookup(nonce=1, sent_at=time.time(), fingerprint="fp", items=[("a", 1, COLS)]),
            SECRET,
        )
        dealer.send(frame)
        reply = open_frame(_answer(dealer), (SECRET,))
        assert isinstance(reply, Reply) and reply.leases[0] and len(server.leases) == 1
        dealer.send(frame)  # the same bytes again (a replay)
        deadline = time.monotonic() + WAIT_S
        while server.counters.requests_denied == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert server.counters.requests_denied == 1, "the replay was refused"
        assert not dealer.poll(NO_ANSWER_MS), "and not answered"
        assert len(server.leases) == 1 and allocator.get("a").pins == 1  # type: ignore[union-attr]
        fresh = Lookup(nonce=2, sent_at=time.time(), fingerprint="fp", items=[("a", 1, COLS)])
        dealer.send(seal(fresh, SECRET))
        assert isinstance(open_frame(_answer(dealer), (SECRET,)), Reply), (
            "a new message is answered"
        )
    finally:
        assert server.stop()
        dealer.close(0)


def test_a_release_meant_for_one_producer_does_not_release_another_producers_lease() -> None:
    """Every engine shares the secret, so a signed Release is valid at every producer
    (a capture replayed to another one, a peer address that now reaches another
    engine, a restarted producer). Lease ids must not be the same small numbers at
    every producer, or it releases that producer's lease of the same key while its
    own consumer still READs under it."""
    one, _ = _producer("a")
    two, allocator_two = _producer("a")
    (first,) = one._answer_all([Lookup(1, 1000.0, "fp", [("a", 1, COLS)])])
    (second,) = two._answer_all([Lookup(1, 1000.0, "fp", [("a", 1, COLS)])])
    assert first.leases[0] and second.leases[0]
    two._give_back([Release(2, 1000.0, [(first.leases[0], ["a"])], read=True)])
    assert allocator_two.get("a").pins == 1, "producer two's consumer still reads a"  # type: ignore[union-attr]
    assert first.leases[0] < 2**53 and second.leases[0] < 2**53, "exact in a handle's JSON"


def test_replays_are_refused_while_fresh_and_forgotten_after() -> None:
    from ec_transfer_nixl.wire import FRESH_S, Replays

    replays = Replays()
    frames = [
        (seal(Lookup(i, 1000.0 + i, "fp", [("a", 1, COLS)]), SECRET), 1000.0 + i) for i in range(3)
    ]
    for frame, sent_at in frames:
        message = open_frame(frame, (SECRET,), sent_at)
        assert replays.first(frame, message, sent_at)
        assert not replays.first(frame, message, sent_at), "the same frame again: a replay"
    frame, sent_at = frames[0]
    message = open_frame(frame, (SECRET,), sent_at)
    assert not replays.first(frame, message, sent_at + FRESH_S), "still fresh: refused"
    assert len(replays) == 3
    later = 1002.0 + FRESH_S + 1  # every frame is stale now: all are forgotten
    fresh = seal(Lookup(9, later, "fp", [("a", 1, COLS)]), SECRET)
    assert replays.first(fresh, open_frame(fresh, (SECRET,), later), later)
    assert len(replays) == 1


def test_a_frame_over_the_size_bound_never_reaches_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ZMQ holds a whole message in memory before its signature can be checked: any
    host reaching the port could make the producer hold gigabytes. A sender past
    MAX_FRAME_BYTES is dropped unread (here the bound is lowered to 64 KiB)."""
    from ec_transfer_nixl import sockets

    monkeypatch.setattr(sockets, "MAX_FRAME_BYTES", 64 << 10)
    server, _, _, dealer = _serving()
    endpoint = dealer.getsockopt(zmq.LAST_ENDPOINT).decode()
    flooder = dealer.context.socket(zmq.DEALER)
    flooder.setsockopt(zmq.LINGER, 0)
    flooder.connect(endpoint)
    try:
        flooder.send(b"\0" * (128 << 10))
        lookup = Lookup(nonce=1, sent_at=time.time(), fingerprint="fp", items=[("a", 1, COLS)])
        dealer.send(seal(lookup, SECRET))
        assert isinstance(open_frame(_answer(dealer), (SECRET,)), Reply), "others are served"
        time.sleep(NO_ANSWER_MS / 1000)  # the big frame, had it been taken, is in by now
        assert server.counters.requests_denied == 0, "the oversized frame was read"
    finally:
        flooder.close(0)
        assert server.stop()
        dealer.close(0)


def test_peer_sockets_bound_the_frames_they_take() -> None:
    from ec_transfer_nixl.sockets import MAX_FRAME_BYTES, peer_socket

    context = zmq.Context()
    try:
        for kind, address in ((zmq.ROUTER, "127.0.0.1:1"), (zmq.DEALER, "[::1]:1")):
            sock = peer_socket(context, kind, PeerAddress.parse("test", address))
            try:
                assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_FRAME_BYTES
                assert sock.getsockopt(zmq.LINGER) == 0
                assert sock.getsockopt(zmq.IPV6) == (address.startswith("["))
            finally:
                sock.close(0)
    finally:
        context.term()


class _EndlessFlood:
    """A ROUTER socket that always has another unsigned two-frame message queued (the
    test's own stop: it runs dry after `limit` messages)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self._frames = 0

    def getsockopt(self, option: int) -> int:
        if option == zmq.EVENTS:
            return zmq.POLLIN if self.taken < self.limit else 0
        assert option == zmq.RCVMORE
        return int(self._frames % 2 == 1)  # the routing id has a body after it

    def recv(self, flags: int = 0) -> bytes:
        self._frames += 1
        if self._frames % 2 == 0:
            self.taken += 1
            return b"\0" * 64  # not signed
        return b"peer"


def test_one_pass_of_the_server_ends_while_a_flood_lasts() -> None:
    """Anyone reaching the port can send faster than signatures are checked: a pass
    must end after BATCH_MAX messages (the rest wait for the next), so the thread
    still answers consumers and lets leases expire between passes."""
    from ec_transfer_nixl import server as server_module

    _, local = _ready_entries(("a",))
    server = PeerServer(
        context=zmq.Context.instance(),
        listen=PeerAddress("127.0.0.1", 1),
        keys=PeerSecrets((SECRET.decode(),)),
        fingerprint="fp",
        local=local,
        make_agent=lambda: None,  # type: ignore[arg-type,return-value]
        spans=lambda runs, nbytes: [],
        itemsize=ITEMSIZE,
        lease_s=30.0,
        counters=PeerCounters(),
    )
    flood = _EndlessFlood(limit=10 * server_module.BATCH_MAX)
    server._serve(flood)  # type: ignore[arg-type]
    assert flood.taken == server_module.BATCH_MAX
    assert server.counters.requests_denied == server_module.BATCH_MAX
