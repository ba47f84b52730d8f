"""A hypothesis state machine over the consumer's fetch protocol (no threads, no sockets).

The Fetcher's steps are driven directly: its peers are fake sockets that record
what it sends, its NIXL agent is a fake whose READs finish only when a rule says
so (or never), and can refuse to cancel. Replies of every kind arrive in any
order, late, or never; time jumps. Several requests' items are asked in one
Lookup per peer, and the items one Reply leased are read with one READ. Some
requests carry a handle's pre-granted lease: the handle requests of one pass
are claimed together, one claim per producer naming each item's lease, and
their READ (one for all of them) starts at once (the first peer's agent is
known) or after the claim's answer (the second's is not). Each lease of a
claim is confirmed, lapsed, or confirmed with other spans, or the producer
answers as one that reads no per-item leases (only the first lease's items).
Checked after every rule:

  * a block is never freed, nor made ready, while a READ into it may still run
    (the quarantine invariant), for lookups' READs and handles' alike;
  * an entry becomes ready only from a READ whose lease the producer confirmed,
    and only if its bytes were read from where the producer said that lease pins
    them;
  * the allocator's own invariants hold;
  * a task whose deadline has passed is done.

At the end, once every READ has finished and time has passed, nothing is
reserved or quarantined, every item landed or failed with a cause, every
item a peer leased was released (after its READ, or unread), and nothing was
released under a lease the peer did not grant this engine.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ec_core.peer_secrets import PeerSecrets
from ec_core.peer_settings import PeerAddress
from ec_core.scheduler_process.allocator import BlockAllocator
from ec_scheduler.remote import LocalEntries, Wanted
from ec_transfer_nixl.counters import PeerCounters
from ec_transfer_nixl.fetcher import Fetcher
from ec_transfer_nixl.links import LINKS_MAX, Link
from ec_transfer_nixl.lookups import SAVING_RETRY_S
from ec_transfer_nixl.tasks import FetchTask, HandleLease, ItemFetch
from ec_transfer_nixl.wire import (
    LAPSED,
    MISSING,
    OK,
    SAVING,
    SHAPE,
    Lookup,
    Release,
    Reply,
    open_frame,
    seal,
)

SECRET = b"model-test-secret"
PEERS = (PeerAddress("10.0.0.1", 1), PeerAddress("10.0.0.2", 2))
KEYS = ("k0", "k1", "k2", "k3")
BLOCK = 64
ITEMSIZE = 4
COLS = 16  # one row = one block
LOOKUP_S, FETCH_S, LEASE_S = 1.0, 4.0, 30.0


class FakeSocket:
    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.closed = False

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.sent.append(open_frame(frame, (SECRET,)))

    def close(self, linger: int = 0) -> None:
        self.closed = True


_now = [1000.0]


@dataclass
class FakeRead:
    blocks: set[int] = field(default_factory=set)
    """The local blocks the READ writes."""
    state: str = "PROC"
    released: bool = False


@dataclass
class FakeAgent:
    name: str = "consumer"
    metadata: bytes = b"md"
    reads: list[FakeRead] = field(default_factory=list)
    refuse_cancel: bool = False
    refuse_release_after_error: bool = False
    """NIXL keeps a READ that failed (it may still write): `release` refuses it."""
    forgotten: list[str] = field(default_factory=list)
    source: dict[int, int] = field(default_factory=dict)
    """Per local block, the remote address the latest READ into it read it from."""

    def know(self, agent: str, metadata: bytes) -> str:
        assert metadata, "an agent is known from its metadata"
        return agent

    def forget(self, agent: str) -> None:
        self.forgotten.append(agent)

    def read(self, peer: str, pieces: Any, notify: bytes = b"") -> FakeRead:
        assert notify == b"", "a notification would make the READ wait for the producer"
        handle = FakeRead()
        for (address, nbytes), (remote, _) in pieces:
            blocks = range(address // BLOCK, -(-(address + nbytes) // BLOCK))
            handle.blocks.update(blocks)
            for block in blocks:
                self.source[block] = remote + block * BLOCK - address
        self.reads.append(handle)
        return handle

    def state(self, handle: FakeRead) -> str:
        return handle.state

    def release(self, handle: FakeRead) -> bool:
        if handle.state == "ERR" and self.refuse_release_after_error:
            return False
        if handle.state == "PROC":
            if self.refuse_cancel:
                return False
            handle.state = "CANCELLED"
        handle.released = True
        return True

    def running(self) -> list[FakeRead]:
        return [r for r in self.reads if r.state == "PROC"]

    def close(self) -> None:
        return None


# Preconditions are named functions, not lambdas: Hypothesis describes a lambda by
# parsing its source with `ast`, which on CPython 3.11.7 now and then fails with
# "SystemError: AST constructor recursion depth mismatch" (a CPython bug), and the
# run then reports a flaky failure that is none of this model's.
def _a_lookup_is_out(machine: FetchMachine) -> bool:
    return any(machine._lookups(p) for p in PEERS)


def _a_read_runs(machine: FetchMachine) -> bool:
    return bool(machine.agent.running())


def _fetcher_over(context: Any) -> tuple[Fetcher, BlockAllocator, LocalEntries]:
    """A fetcher (thread not started, a FakeAgent as its agent, the test clock) over a
    small allocator of its own (6 blocks: reservations can fail)."""
    allocator = BlockAllocator(6)
    local = LocalEntries(
        allocator, threading.RLock(), allocator.unpin, lambda key: False, lambda r, c: r
    )
    fetcher = Fetcher(
        context=context,
        keys=PeerSecrets((SECRET.decode(),)),
        fingerprint="fp",
        local=local,
        make_agent=FakeAgent,  # type: ignore[arg-type]
        spans=lambda runs, nbytes: [(first * BLOCK, count * BLOCK) for first, count in runs],
        itemsize=ITEMSIZE,
        counters=PeerCounters(),
        on_failed=lambda key, cause: None,
        embed_width=COLS,
        clock=lambda: _now[0],
    )
    fetcher.agent = FakeAgent()  # type: ignore[assignment]
    return fetcher, allocator, local


class FetchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        _now[0] = 1000.0
        self.fetcher, self.allocator, self.local = _fetcher_over(None)
        self.agent: FakeAgent = self.fetcher.agent  # type: ignore[assignment]
        self.sockets = {peer: FakeSocket() for peer in PEERS}
        for peer, sock in self.sockets.items():
            self.fetcher._links.by_peer[peer] = Link(sock)  # type: ignore[arg-type]
        self.fetcher._links.by_peer[
            PEERS[0]
        ].agent = "producer"  # known: handle READs start at once
        self.tasks: list[FetchTask] = []
        self.leased: dict[tuple[PeerAddress, int], set[str]] = {}
        self.lease_ids = iter(range(1, 10_000))
        self.handle_spans: dict[int, dict[str, list[tuple[int, int]]]] = {}
        self.vouched: set[tuple[str, int]] = set()
        """`(key, address)`: a producer said a lease it granted this engine pins the
        key's bytes from that address on."""
        self.count = 0

    # ------------------------------------------------------------- rules

    @initialize(refuse=st.booleans())
    def nixl_starts_out(self, refuse: bool) -> None:
        """Half the runs begin with a NIXL that will not cancel a running READ."""
        self.agent.refuse_cancel = refuse

    @rule(
        keys=st.sets(st.sampled_from(KEYS), min_size=1),
        peers=st.sets(st.sampled_from(PEERS), min_size=1),
    )
    def new_request(self, keys: set[str], peers: set[PeerAddress]) -> None:
        keys = self._idle(keys)
        if keys:
            self._begin(keys, 1 + self.count % 2, peers, None)

    def _idle(self, keys: set[str]) -> set[str]:
        """The keys no task is fetching: the source gives each item to one task at a
        time (NixlRemoteSource.wants)."""
        return keys - {k for t in self.fetcher._deadlines.tasks for k in t.items}

    def _begin(
        self, keys: set[str], rows: int, peers: set[PeerAddress], handle: HandleLease | None
    ) -> None:
        self.count += 1
        task = FetchTask(
            request_id=f"r{self.count}",
            items={k: ItemFetch(Wanted(k, rows, COLS)) for k in sorted(keys)},
            candidates=tuple(sorted(peers, key=str)),
            lookup_deadline=_now[0] + LOOKUP_S,
            deadline=_now[0] + FETCH_S,
            handle=handle,
        )
        self.tasks.append(task)
        self.fetcher._begin(task)  # its lookups go out at the next pass

    @rule(keys=st.sets(st.sampled_from(KEYS), min_size=1), peer=st.sampled_from(PEERS))
    def new_request_with_a_handle(self, keys: set[str], peer: PeerAddress) -> None:
        self._begin_with_a_handle(keys, peer)

    @rule(
        requests=st.lists(
            st.tuples(st.sets(st.sampled_from(KEYS), min_size=1, max_size=2), st.booleans()),
            min_size=2,
            max_size=3,
        )
    )
    def a_step_of_requests_with_handles(self, requests: list[tuple[set[str], bool]]) -> None:
        """Several handle requests handed over in one step (most at the first peer):
        claimed together at the next pass."""
        for keys, elsewhere in requests:
            self._begin_with_a_handle(keys, PEERS[1] if elsewhere else PEERS[0])

    def _begin_with_a_handle(self, keys: set[str], peer: PeerAddress) -> None:
        keys = self._idle(keys)
        if not keys:
            return
        rows = 1 + (self.count + 1) % 2
        lease = next(self.lease_ids)
        handle = HandleLease(
            peer=peer,
            lease=lease,
            agent="producer",
            spans={k: [(1000 * lease, rows * COLS * ITEMSIZE)] for k in keys},
            shapes=dict.fromkeys(keys, (rows, COLS)),
        )
        self.handle_spans[lease] = handle.spans
        self._begin(keys, rows, {peer, *PEERS[:1]}, handle)

    @rule()
    def a_pass(self) -> None:
        self.fetcher._tick(_now[0])

    @precondition(_a_lookup_is_out)
    @rule(data=st.data())
    def a_peer_answers(self, data: st.DataObject) -> None:
        peer = data.draw(st.sampled_from([p for p in PEERS if self._lookups(p)]))
        lookup = data.draw(st.sampled_from(self._lookups(peer)))
        self.sockets[peer].sent.remove(lookup)
        if data.draw(st.integers(0, 9)) == 0:
            reply = self._reply(lookup, status="incompatible", results=[])
            event("incompatible")
        elif lookup.claims:
            reply = self._answer_claim(peer, lookup, data)
        else:
            results = []
            for key, rows, cols in lookup.items:
                status = data.draw(st.sampled_from([OK, OK, MISSING, SAVING, SHAPE]))
                spans = [(0, rows * cols * ITEMSIZE)] if status == OK else []
                results.append((key, status, spans))
            reply = self._reply(lookup, status=OK, results=results)
            leased = {k for k, s, _ in results if s == OK}
            if leased:
                self.leased[(peer, _lease_of(reply))] = leased
        if reply.status == OK:
            self.vouched.update((key, spans[0][0]) for key, status, spans in reply.results if spans)
        self.fetcher._lookups.apply(self.fetcher._links.by_peer[peer], reply)

    @precondition(_a_lookup_is_out)
    @rule(data=st.data())
    def a_lookup_is_lost(self, data: st.DataObject) -> None:
        peer = data.draw(st.sampled_from([p for p in PEERS if self._lookups(p)]))
        self.sockets[peer].sent.remove(self._lookups(peer)[0])

    @precondition(_a_read_runs)
    @rule(data=st.data(), ok=st.booleans())
    def a_read_finishes(self, data: st.DataObject, ok: bool) -> None:
        read = data.draw(st.sampled_from(self.agent.running()))
        read.state = "DONE" if ok else "ERR"

    @rule(refuse=st.booleans())
    def cancelling_is(self, refuse: bool) -> None:
        self.agent.refuse_cancel = refuse

    @rule(seconds=st.sampled_from([0.001, 0.02, 0.5, 1.5, 5.0]))
    def time_passes(self, seconds: float) -> None:
        _now[0] += seconds
        self.fetcher._tick(_now[0])

    # -------------------------------------------------------- invariants

    @invariant()
    def no_reservation_freed_under_a_running_read(self) -> None:
        owner = {block: entry for entry in self.allocator for block in entry.block_ids}
        for read in self.agent.running():
            for block in read.blocks:
                entry = owner.get(block)
                assert entry is not None, f"block {block} freed under a READ"
                assert not entry.ready, f"{entry.key} made ready while a READ writes it"

    @invariant()
    def only_confirmed_reads_land(self) -> None:
        for group in self.fetcher._reads.running + self.fetcher._reads.awaiting:
            if not group.answered:
                for item in group.items:
                    assert item.outcome != "landed"
                    entry = self.allocator.get(item.wanted.key)
                    assert entry is not None and not entry.ready

    @invariant()
    def ready_entries_hold_vouched_bytes(self) -> None:
        """A fetched entry is ready only if it was read from where its producer said a
        lease granted to this engine pins it (a lapsed, refused or moved claim's bytes
        never land)."""
        for entry in self.allocator:
            if entry.ready:
                source = self.agent.source.get(entry.runs[0][0])
                assert (entry.key, source) in self.vouched, f"{entry.key} landed unvouched bytes"

    @invariant()
    def allocator_consistent(self) -> None:
        self.allocator.check()

    @invariant()
    def past_their_deadline_tasks_are_done(self) -> None:
        for task in self.tasks:
            if _now[0] > task.deadline:
                assert task.done, f"{task.request_id} is open past its deadline"

    def teardown(self) -> None:
        for read in self.agent.reads:
            if read.state == "PROC":
                read.state = "DONE"
        self.agent.refuse_cancel = False
        for _ in range(3):
            _now[0] += FETCH_S + 1
            self.fetcher._tick(_now[0])
        assert all(t.done for t in self.tasks)
        assert self.fetcher.quarantined == 0
        for task in self.tasks:
            for item in task.items.values():
                assert item.outcome is not None
        assert not self.allocator.has_held_entries(), "a reservation was never freed"
        released = {
            (peer, lease, key)
            for peer, sock in self.sockets.items()
            for message in sock.sent
            if isinstance(message, Release)
            for lease, keys in message.leases
            for key in keys
        }
        granted = {
            (peer, lease, key) for (peer, lease), keys in self.leased.items() for key in keys
        }
        for peer, lease, key in granted:
            assert (peer, lease, key) in released, (
                f"{key} leased by {peer} (lease {lease}) was never released"
            )
        for peer, lease, key in released:
            assert (peer, lease, key) in granted, (
                f"{key} released under lease {lease} of {peer}, which never granted it here"
            )
        counters = self.fetcher.counters
        decided = counters.remote_hits + sum(counters.fallbacks.values())
        assert decided == sum(len(t.items) for t in self.tasks)

    # ----------------------------------------------------------- helpers

    def _lookups(self, peer: PeerAddress) -> list[Lookup]:
        return [m for m in self.sockets[peer].sent if isinstance(m, Lookup)]

    def _answer_claim(self, peer: PeerAddress, lookup: Lookup, data: st.DataObject) -> Reply:
        """A producer's answer to a claim: each lease named confirmed, lapsed, or
        confirmed with other spans."""
        answers = {
            lease: data.draw(st.sampled_from(["confirm", "confirm", "lapsed", "moved"]))
            for lease in dict.fromkeys(lookup.claims)
        }
        event(f"claim of {len(answers)} leases")
        for answer in answers.values():
            event(f"claimed lease {answer}")
        return self.claim_answer(peer, lookup, answers)

    def claim_answer(self, peer: PeerAddress, lookup: Lookup, answers: dict[int, str]) -> Reply:
        """The answer to `lookup` (a claim) with, per lease, "confirm", "lapsed" or
        "moved" (other spans; a lease not named: lapsed)."""
        under = lookup.claims
        results: list[Any] = []
        leases: list[int] = []
        for (key, _, _), lease in zip(lookup.items, under, strict=True):
            spans = self.handle_spans[lease].get(key)
            answer = answers.get(lease, "lapsed")
            if answer == "lapsed" or spans is None:
                results.append((key, LAPSED, []))
                leases.append(0)
                continue
            shift = 8 if answer == "moved" else 0
            results.append((key, OK, [(a + shift, n) for a, n in spans]))
            leases.append(lease)
            self.leased.setdefault((peer, lease), set()).add(key)
        return Reply(
            nonce=lookup.nonce,
            sent_at=_now[0],
            status=OK,
            agent="producer",
            agent_metadata=b"" if lookup.known_agent == "producer" else b"md",
            lease_s=LEASE_S,
            results=results,
            leases=leases,
            shapes=[],
        )

    def _reply(self, lookup: Lookup, *, status: str, results: list[Any]) -> Reply:
        lease = next(self.lease_ids) if results else 0
        return Reply(
            nonce=lookup.nonce,
            sent_at=_now[0],
            status=status,
            agent="producer",
            agent_metadata=b"md",
            lease_s=LEASE_S,
            results=results,
            leases=[lease if s == OK else 0 for _, s, _ in results],
            shapes=[],
        )


def _lease_of(reply: Reply) -> int:
    """The lease a lookup's Reply grants (0: none)."""
    return next((lease for lease in reply.leases if lease), 0)


TestFetchProtocol = FetchMachine.TestCase
TestFetchProtocol.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_a_steps_requests_share_one_lookup_and_one_read_per_peer() -> None:
    """Three requests handed over in one step: one Lookup per peer for all their items,
    and the items one Reply leased are read with one READ; all land."""
    machine = FetchMachine()
    peer = PEERS[0]
    tasks = [
        FetchTask(
            request_id=f"r{i}",
            items={key: ItemFetch(Wanted(key, 1, COLS))},
            candidates=(peer,),
            lookup_deadline=_now[0] + LOOKUP_S,
            deadline=_now[0] + FETCH_S,
        )
        for i, key in enumerate(KEYS[:3])
    ]
    for task in tasks:
        machine.fetcher._begin(task)
    assert machine._lookups(peer) == [], "nothing is sent before the pass"
    machine.fetcher._tick(_now[0])
    (lookup,) = machine._lookups(peer)
    assert [key for key, _, _ in lookup.items] == list(KEYS[:3])
    results = [(key, OK, [(0, rows * cols * ITEMSIZE)]) for key, rows, cols in lookup.items]
    machine.fetcher._lookups.apply(
        machine.fetcher._links.by_peer[peer], machine._reply(lookup, status=OK, results=results)
    )
    (read,) = machine.agent.reads
    assert len(read.blocks) == 3
    read.state = "DONE"
    machine.fetcher._tick(_now[0])
    assert all(task.done for task in tasks)
    assert machine.fetcher.counters.remote_hits == 3
    (release,) = [m for m in machine.sockets[peer].sent if isinstance(m, Release)]
    ((_, keys),) = release.leases
    assert release.read and sorted(keys) == list(KEYS[:3])


# ------------------------------------------------------ batched handle claims


def _handle_task(machine: FetchMachine, key: str, lease: int) -> FetchTask:
    """A request for `key` whose handle carries lease `lease` at the first peer (whose
    agent this engine knows: its READ starts at once)."""
    spans = {key: [(1000 * lease, COLS * ITEMSIZE)]}
    machine.handle_spans[lease] = spans
    return FetchTask(
        request_id=f"r-{key}",
        items={key: ItemFetch(Wanted(key, 1, COLS))},
        candidates=(PEERS[0],),
        lookup_deadline=_now[0] + LOOKUP_S,
        deadline=_now[0] + FETCH_S,
        handle=HandleLease(
            peer=PEERS[0], lease=lease, agent="producer", spans=spans, shapes={key: (1, COLS)}
        ),
    )


def _one_step_of_handles(machine: FetchMachine, leases: dict[str, int]) -> list[FetchTask]:
    """Hand over one request per key (with its lease) in one step, and run one pass."""
    tasks = [_handle_task(machine, key, lease) for key, lease in leases.items()]
    for task in tasks:
        machine.fetcher._begin(task)
    assert machine._lookups(PEERS[0]) == [] and machine.agent.reads == [], "all at the pass"
    machine.fetcher._tick(_now[0])
    return tasks


def _claim_reply(machine: FetchMachine, lookup: Lookup, answers: dict[int, str]) -> Reply:
    """The first peer's answer to `lookup`: per lease "confirm", "lapsed" or "moved"."""
    return machine.claim_answer(PEERS[0], lookup, answers)


def _released(machine: FetchMachine) -> dict[int, list[str]]:
    """Lease -> keys the consumer released, over every Release it sent the first peer."""
    out: dict[int, list[str]] = {}
    for message in machine.sockets[PEERS[0]].sent:
        if isinstance(message, Release):
            for lease, keys in message.leases:
                out.setdefault(lease, []).extend(keys)
    return out


def _finish_reads(machine: FetchMachine) -> None:
    for read in machine.agent.running():
        read.state = "DONE"
    machine.fetcher._tick(_now[0])


def test_a_steps_handles_are_claimed_in_one_message_and_read_with_one_read() -> None:
    """Three handle requests of one step at one producer: one claim naming the three
    leases, one READ of all three started before it; confirmed, all land, and one Release gives
    the three leases back."""
    machine = FetchMachine()
    tasks = _one_step_of_handles(machine, {"k0": 11, "k1": 12, "k2": 13})
    (read,) = machine.agent.reads
    assert len(read.blocks) == 3 and machine.fetcher.handle_reads == 3
    assert machine.fetcher.handle_batches == 1
    (claim,) = machine._lookups(PEERS[0])
    assert [key for key, _, _ in claim.items] == ["k0", "k1", "k2"]
    assert claim.claims == [11, 12, 13]
    machine.sockets[PEERS[0]].sent.remove(claim)
    confirm = _claim_reply(machine, claim, dict.fromkeys((11, 12, 13), "confirm"))
    machine.fetcher._lookups.apply(machine.fetcher._links.by_peer[PEERS[0]], confirm)
    assert not any(task.done for task in tasks), "not before the READ is over"
    _finish_reads(machine)
    assert all(task.done for task in tasks)
    assert all(item.outcome == "landed" for t in tasks for item in t.items.values())
    (release,) = [m for m in machine.sockets[PEERS[0]].sent if isinstance(m, Release)]
    assert release.read and release.leases == [(11, ["k0"]), (12, ["k1"]), (13, ["k2"])]
    assert not machine.allocator.has_held_entries()


def test_one_lapsed_lease_among_several_is_asked_again_once_the_read_is_over() -> None:
    """The READ ends before the claim's answer; of three leases one lapsed: the other
    two land, the lapsed one's blocks are freed (the READ is over) and its item is
    looked up as usual, then fetched; only the granted leases are given back."""
    machine = FetchMachine()
    tasks = _one_step_of_handles(machine, {"k0": 21, "k1": 22, "k2": 23})
    (claim,) = machine._lookups(PEERS[0])
    machine.sockets[PEERS[0]].sent.remove(claim)
    _finish_reads(machine)
    assert not any(task.done for task in tasks), "no bytes count before the claim's answer"
    answers = {21: "confirm", 22: "lapsed", 23: "confirm"}
    machine.fetcher._lookups.apply(
        machine.fetcher._links.by_peer[PEERS[0]], _claim_reply(machine, claim, answers)
    )
    assert tasks[0].items["k0"].outcome == "landed" and tasks[2].items["k2"].outcome == "landed"
    assert machine.allocator.get("k1") is None, "the lapsed item's blocks are freed"
    machine.fetcher._tick(_now[0])
    assert tasks[0].done and tasks[2].done and not tasks[1].done
    assert _released(machine) == {21: ["k0"], 23: ["k2"]}, "never the lapsed lease"
    (lookup,) = machine._lookups(PEERS[0])
    assert lookup.claims == [] and lookup.items == [("k1", 1, COLS)]
    machine.sockets[PEERS[0]].sent.remove(lookup)
    reply = machine._reply(lookup, status=OK, results=[("k1", OK, [(0, COLS * ITEMSIZE)])])
    machine.fetcher._lookups.apply(machine.fetcher._links.by_peer[PEERS[0]], reply)
    _finish_reads(machine)
    assert tasks[1].done and tasks[1].items["k1"].outcome == "landed"
    assert _released(machine)[_lease_of(reply)] == ["k1"]
    assert not machine.allocator.has_held_entries()


def test_a_refused_claim_lands_nothing_and_releases_only_what_it_was_granted() -> None:
    """One lease lapsed, the other confirmed at other spans (the entry moved): no byte
    of the READ lands; the moved one's lease was granted, so it goes back; both items
    are looked up again."""
    machine = FetchMachine()
    tasks = _one_step_of_handles(machine, {"k0": 31, "k1": 32})
    (claim,) = machine._lookups(PEERS[0])
    machine.sockets[PEERS[0]].sent.remove(claim)
    reply = _claim_reply(machine, claim, {31: "lapsed", 32: "moved"})
    machine.fetcher._lookups.apply(machine.fetcher._links.by_peer[PEERS[0]], reply)
    assert machine.allocator.get("k0") is not None, "blocks held while the READ may write"
    _finish_reads(machine)
    for task in tasks:
        item = next(iter(task.items.values()))
        assert item.outcome is None and not item.reading
        assert machine.allocator.get(item.wanted.key) is None
    assert _released(machine) == {32: ["k1"]}
    (lookup,) = machine._lookups(PEERS[0])
    assert lookup.claims == [] and sorted(key for key, _, _ in lookup.items) == ["k0", "k1"]


def test_a_producer_gone_mid_read_leaves_nothing_pinned_or_leaked() -> None:
    """The claim is never answered and NIXL will not cancel the READ: at the lookup
    deadline the items fail (unreachable), the producer is not asked for a while,
    and the blocks stay reserved until the READ ends; nothing is released (nothing
    was granted), until a late answer comes: then what it granted goes back."""
    machine = FetchMachine()
    machine.agent.refuse_cancel = True
    tasks = _one_step_of_handles(machine, {"k0": 51, "k1": 52})
    (claim,) = machine._lookups(PEERS[0])
    machine.sockets[PEERS[0]].sent.remove(claim)
    _now[0] += LOOKUP_S + 0.1
    machine.fetcher._tick(_now[0])
    assert all(task.done for task in tasks)
    assert {item.outcome for t in tasks for item in t.items.values()} == {"unreachable"}
    assert machine.fetcher._links.by_peer[PEERS[0]].down_until > _now[0]
    assert machine.fetcher.quarantined == 1
    assert all(not machine.allocator.get(k).ready for k in ("k0", "k1"))  # type: ignore[union-attr]
    _finish_reads(machine)
    assert machine.fetcher.quarantined == 0 and not machine.allocator.has_held_entries()
    assert _released(machine) == {}
    late = _claim_reply(machine, claim, dict.fromkeys((51, 52), "confirm"))
    machine.fetcher._lookups.apply(machine.fetcher._links.by_peer[PEERS[0]], late)
    assert _released(machine) == {51: ["k0"], 52: ["k1"]}
    assert not machine.allocator.has_held_entries()


def test_a_claim_unanswered_after_its_read_is_over_fails_its_items_and_frees_them() -> None:
    """The READ ends, the claim's answer never comes: at the lookup deadline the items
    fail (unreachable), their blocks are freed at once (the READ writes no more), the
    producer is not asked for a while, and nothing is released (nothing was granted)."""
    machine = FetchMachine()
    tasks = _one_step_of_handles(machine, {"k0": 61, "k1": 62})
    (claim,) = machine._lookups(PEERS[0])
    machine.sockets[PEERS[0]].sent.remove(claim)
    _finish_reads(machine)
    assert not any(task.done for task in tasks), "no bytes count before the claim's answer"
    _now[0] += LOOKUP_S + 0.1
    machine.fetcher._tick(_now[0])
    assert all(task.done for task in tasks)
    assert {item.outcome for t in tasks for item in t.items.values()} == {"unreachable"}
    assert machine.fetcher._links.by_peer[PEERS[0]].down_until > _now[0]
    assert machine.fetcher.quarantined == 0 and not machine.allocator.has_held_entries()
    assert _released(machine) == {}


def _asked(machine: FetchMachine, task: FetchTask) -> Lookup:
    """Start `task` and run one pass: the Lookup it sent to the first peer."""
    machine.fetcher._begin(task)
    machine.fetcher._tick(_now[0])
    return next(m for m in machine.sockets[PEERS[0]].sent if isinstance(m, Lookup))


def _ready_in_one_span(machine: FetchMachine, lookup: Lookup) -> Reply:
    """The first peer's answer to `lookup`: KEYS[0] ready, in one span, sent now."""
    return machine._reply(lookup, status=OK, results=[(KEYS[0], OK, [(0, COLS * ITEMSIZE)])])


def _task(request_id: str, key: str) -> FetchTask:
    return FetchTask(
        request_id=request_id,
        items={key: ItemFetch(Wanted(key, 1, COLS))},
        candidates=(PEERS[0],),
        lookup_deadline=_now[0] + LOOKUP_S,
        deadline=_now[0] + FETCH_S,
    )


def test_a_steps_tasks_are_taken_on_together_after_its_kick_however_busy_the_thread() -> None:
    """Tasks submitted during a step wait for the step's kick, even while the thread
    runs passes (READs polled every 50 µs); then a pass takes them all at once, and
    a task staged with no kick is still taken on after IDLE_POLL_MS."""
    from ec_transfer_nixl.intake import IDLE_POLL_MS

    machine = FetchMachine()
    fetcher = machine.fetcher
    first, second = _task("r0", KEYS[0]), _task("r1", KEYS[1])
    fetcher.submit(first)
    assert fetcher._intake.take() == []  # a pass in the middle of the step takes nothing
    fetcher.submit(second)
    fetcher.kick()
    assert fetcher._intake.take() == [first, second]
    assert fetcher._intake.take() == []
    late = _task("r2", KEYS[2])
    fetcher.submit(late)
    _now[0] += IDLE_POLL_MS / 1000 / 2
    assert fetcher._intake.take() == []
    _now[0] += IDLE_POLL_MS / 1000
    assert fetcher._intake.take() == [late]


def test_tasks_never_taken_on_fail_when_the_fetcher_stops() -> None:
    """A task staged or handed over when the thread ends is done, every item failed."""
    machine = FetchMachine()
    fetcher = machine.fetcher
    handed, staged = _task("r0", KEYS[0]), _task("r1", KEYS[1])
    fetcher.submit(handed)
    fetcher.kick()
    fetcher.submit(staged)
    fetcher._shutdown()
    for task in (handed, staged):
        assert task.done
        assert all(item.outcome == "timeout" for item in task.items.values())


def test_a_reply_span_of_negative_length_never_writes_outside_the_reservation() -> None:
    """A peer holding the secret (buggy or hostile) whose spans add up to the size but
    one of which is negative: the READ must not write this engine's other entries."""
    machine = FetchMachine()
    fetcher, allocator, peer = machine.fetcher, machine.allocator, PEERS[0]
    assert machine.local.reserve("here", 2, COLS) is not None  # a ready entry below
    assert machine.local.landed("here")
    fetcher._begin(_task("r0", KEYS[0]))
    fetcher._tick(_now[0])
    lookup = next(m for m in machine.sockets[peer].sent if isinstance(m, Lookup))
    nbytes = COLS * ITEMSIZE
    reply = machine._reply(
        lookup, status=OK, results=[(KEYS[0], OK, [(5000, -BLOCK), (6000, nbytes + BLOCK)])]
    )
    fetcher._lookups.apply(fetcher._links.by_peer[peer], reply)
    entry = allocator.get(KEYS[0])
    reserved = set(entry.block_ids) if entry is not None else set()
    for read in machine.agent.reads:
        assert read.blocks <= reserved, f"a READ writes blocks {sorted(read.blocks - reserved)}"
    assert machine.agent.reads == []  # such spans are not read at all
    assert allocator.get(KEYS[0]) is None  # nor is anything left reserved
    assert allocator.get("here") is not None and allocator.get("here").ready


class _Inbox:
    """A DEALER socket with frames waiting to be received."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames

    def getsockopt(self, option: int) -> int:
        return zmq.POLLIN if self.frames else 0

    def recv(self, flags: int = 0) -> bytes:
        return self.frames.pop(0)


def test_a_reply_that_names_no_lease_per_result_is_dropped() -> None:
    """Every Reply names, per result, the lease that holds it: one that does not is
    dropped unread (a READ under no lease would never be released), the next read."""
    machine = FetchMachine()
    fetcher, peer = machine.fetcher, PEERS[0]
    lookup = _asked(machine, _task("r0", KEYS[0]))
    good = msgspec.structs.replace(_ready_in_one_span(machine, lookup), sent_at=time.time())
    bad = msgspec.structs.replace(good, leases=[])
    inbox = _Inbox([seal(bad, SECRET), seal(good, SECRET)])
    fetcher._links.by_peer[peer] = Link(inbox)  # type: ignore[arg-type]
    assert list(fetcher._links.replies({inbox: zmq.POLLIN})) == [
        (fetcher._links.by_peer[peer], good)
    ]


def test_a_reply_taken_late_off_the_socket_does_not_stretch_the_producers_lease() -> None:
    """The producer's lease runs from when it answered, at the latest from when the
    lookup was sent, not from when this thread got to the reply: a READ that ends
    after the lookup's send + lease_s may read blocks the producer already reused."""
    machine = FetchMachine()
    fetcher, peer = machine.fetcher, PEERS[0]
    task = _task("r0", KEYS[0])
    task.deadline = _now[0] + 10
    sent = _now[0]
    lookup = _asked(machine, task)
    reply = _ready_in_one_span(machine, lookup)
    # This producer's ec_peer_lease_s: its pins went at sent + 3 s at the latest.
    reply.lease_s = 3.0
    _now[0] += 2.0  # the thread took the reply off the socket 2 s after it was sent (busy host)
    fetcher._lookups.apply(fetcher._links.by_peer[peer], reply)
    (read,) = machine.agent.running()
    _now[0] = sent + 3.5  # the READ ends after the producer's lease did
    read.state = "DONE"
    fetcher._tick(_now[0])
    assert task.items[KEYS[0]].outcome != "landed"


def _task_at(request_id: str, peer: PeerAddress) -> FetchTask:
    return FetchTask(
        request_id=request_id,
        items={request_id: ItemFetch(Wanted(request_id, 1, COLS))},
        candidates=(peer,),
        lookup_deadline=_now[0] + LOOKUP_S,
        deadline=_now[0] + FETCH_S,
    )


def test_a_peer_address_zeromq_refuses_fails_its_items_and_the_fetcher_goes_on() -> None:
    """A request's ec_transfer_params (client input) may name any peer that passes
    PeerAddress.parse; one ZeroMQ cannot connect to must fail that fetch, not raise
    out of the fetcher thread's pass (which would end the thread: every later fetch
    would never be done, and its request would wait forever)."""
    import zmq

    context = zmq.Context()
    try:
        fetcher = _fetcher_over(context)[0]
        task = _task_at("r0", PeerAddress.parse("ec_transfer_params.peer", "-:5"))
        fetcher._begin(task)
        fetcher._tick(_now[0])
        _now[0] += LOOKUP_S + 0.1
        fetcher._tick(_now[0])
        assert task.done
        assert task.items["r0"].outcome == "unreachable"
        fetcher._shutdown()
    finally:
        context.destroy(linger=0)


def test_the_links_to_peers_stay_bounded_whatever_peers_handles_name() -> None:
    """Each handle may name another producer: links to peers no open fetch uses are
    dropped, so ZeroMQ's socket limit (1023 per context) is never reached."""
    import zmq

    class Context:
        open = 0

        def socket(self, kind: int) -> Any:
            if Context.open >= 1023:
                raise zmq.ZMQError(24)  # EMFILE, as ZeroMQ's max sockets
            Context.open += 1
            sock = FakeSocket()
            sock.setsockopt = lambda *args: None  # type: ignore[attr-defined]
            sock.connect = lambda address: None  # type: ignore[attr-defined]

            def close(linger: int = 0) -> None:
                Context.open -= 1

            sock.close = close  # type: ignore[method-assign]
            return sock

    fetcher = _fetcher_over(Context())[0]
    for i in range(1100):
        task = _task_at(f"r{i}", PeerAddress("10.255.0.1", 1000 + i))
        fetcher._begin(task)
        fetcher._tick(_now[0])
        _now[0] += LOOKUP_S + 0.1
        fetcher._tick(_now[0])
        assert task.done
    later = _task_at("later", PeerAddress("10.0.0.9", 9))
    fetcher._begin(later)
    fetcher._tick(_now[0])
    assert later.items["later"].asked, "the lookup of a later fetch went out"
    assert len(fetcher._links.by_peer) <= LINKS_MAX + 1


def test_a_link_asked_lately_is_kept_so_a_late_reply_still_releases_its_lease() -> None:
    """A fetch given up at its lookup deadline leaves no open work on its link; the
    producer's reply may still come, pinning the item under a lease. Dropping that link
    as idle would close the socket before the reply is read, leaving the pin until the
    lease expires; so a link asked lately is kept, and dropped once it is not."""
    from ec_transfer_nixl.links import LATE_REPLY_S

    machine = FetchMachine()
    fetcher, peer = machine.fetcher, PEERS[0]
    task = _task("r0", KEYS[0])
    lookup = _asked(machine, task)
    _now[0] += LOOKUP_S + 0.1
    fetcher._tick(_now[0])
    assert task.done and not fetcher._lookups.pending, "given up: nothing open on the link"
    fetcher._drop_idle_links()
    assert peer in fetcher._links.by_peer, "asked lately: kept for a late reply"
    reply = _ready_in_one_span(machine, lookup)
    fetcher._lookups.apply(fetcher._links.by_peer[peer], reply)
    release = machine.sockets[peer].sent[-1]
    assert isinstance(release, Release) and [k for _, ks in release.leases for k in ks] == [
        KEYS[0]
    ], "the late lease goes"
    _now[0] += LATE_REPLY_S
    fetcher._drop_idle_links()
    assert peer not in fetcher._links.by_peer, "not asked for LATE_REPLY_S: dropped"


def test_a_failed_read_nixl_still_holds_keeps_its_blocks_until_nixl_lets_go() -> None:
    """NIXL says a READ failed but will not release it: it may still write the
    reserved blocks, so they stay reserved (quarantined) while its item fails."""
    machine = FetchMachine()
    fetcher, allocator, peer = machine.fetcher, machine.allocator, PEERS[0]
    task = _task("r0", KEYS[0])
    lookup = _asked(machine, task)
    reply = _ready_in_one_span(machine, lookup)
    fetcher._lookups.apply(fetcher._links.by_peer[peer], reply)
    (read,) = machine.agent.running()
    machine.agent.refuse_release_after_error = True
    read.state = "ERR"
    fetcher._tick(_now[0])
    assert task.items[KEYS[0]].outcome == "read_error"
    assert fetcher.quarantined == 1
    entry = allocator.get(KEYS[0])
    assert entry is not None and not entry.ready, "its blocks stay reserved"
    machine.agent.refuse_release_after_error = False
    fetcher._tick(_now[0])
    assert fetcher.quarantined == 0 and allocator.get(KEYS[0]) is None


def test_an_agent_two_links_share_is_forgotten_only_with_the_last() -> None:
    """One producer reached under two addresses has one NIXL agent: dropping the
    idle link must not forget the agent the other link still reads from."""
    machine = FetchMachine()
    fetcher = machine.fetcher
    busy, idle = PEERS[0], PeerAddress("10.255.0.2", 7)
    fetcher._links.by_peer[busy].agent = "producer"
    fetcher._links.by_peer[idle] = Link(FakeSocket(), agent="producer")  # type: ignore[arg-type]
    fetcher._deadlines.tasks.append(_task("r0", KEYS[0]))  # its candidates include `busy`
    assert (
        busy in fetcher._deadlines.tasks[0].candidates
        and idle not in fetcher._deadlines.tasks[0].candidates
    )
    fetcher._drop_idle_links()
    assert idle not in fetcher._links.by_peer and busy in fetcher._links.by_peer
    assert machine.agent.forgotten == []
    fetcher._deadlines.tasks.clear()
    fetcher._drop_idle_links()
    assert machine.agent.forgotten == ["producer"]


# ------------------------------------------------- the scheduler thread's seam


def _source_over(fetcher: Fetcher, local: LocalEntries) -> Any:
    """A NixlRemoteSource (no region, no sockets, no threads of its own) whose fetcher
    is `fetcher`, taken for running, asking the first peer: `wants` as the scheduler
    thread calls it, the fetcher's passes driven by the test."""
    from collections import OrderedDict

    from ec_core.peer_settings import PeerSettings
    from ec_core.ratelimit import RateLimitedWarnings
    from ec_transfer_nixl.source import NixlRemoteSource, logger

    fetcher._thread = threading.current_thread()  # alive: `running` holds
    source = NixlRemoteSource.__new__(NixlRemoteSource)
    source._settings = PeerSettings(
        listen=None,
        peers=PEERS[:1],
        secrets=(SECRET.decode(),),
        lookup_timeout_s=LOOKUP_S,
        fetch_timeout_s=FETCH_S,
    )
    source._local = local
    source.counters = fetcher.counters
    source._warnings = RateLimitedWarnings(logger)
    source.fingerprint = "fp"
    source._keys = PeerSecrets((SECRET.decode(),))
    source._tasks, source._fetching, source._finished = {}, {}, []
    source._negative = OrderedDict()
    source._closed = False
    source.fetcher = fetcher
    source.advertised = None  # a consumer only: `request_finished` hands out no handle
    return source


def _request(request_id: str, **params: Any) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(request_id=request_id, ec_transfer_params=params or None, mm_features=[])


def _the_steps_lookup(machine: FetchMachine, source: Any) -> Lookup:
    """End the scheduler's step: begin the fetches it handed over and run one pass.
    The one Lookup this sent the first peer, taken off its socket to be answered."""
    source.step_done()
    for task in machine.fetcher._intake.take():
        machine.fetcher._begin(task)
    machine.fetcher._tick(_now[0])
    (lookup,) = machine._lookups(PEERS[0])
    machine.sockets[PEERS[0]].sent.remove(lookup)
    return lookup


def test_a_request_waits_for_another_requests_fetch_after_its_own_fetch_is_done() -> None:
    """r2 needs k0, which r1's fetch brings, and k1, which r2's own fetch brings. Once
    r2's fetch is done, k0's is still in flight: r2 must keep waiting for it (as on its
    first call), not go on and encode k0 while its bytes are about to land."""
    machine = FetchMachine()
    fetcher, peer = machine.fetcher, PEERS[0]
    source = _source_over(fetcher, machine.local)
    k0, k1 = Wanted("k0", 1, COLS), Wanted("k1", 1, COLS)
    r1, r2 = _request("r1"), _request("r2")
    assert source.wants(r1, [k0])
    assert source.wants(r2, [k0, k1]), "k0 is on its way, k1 is fetched for r2"
    lookup = _the_steps_lookup(machine, source)
    results = [("k0", SAVING, []), ("k1", OK, [(0, COLS * ITEMSIZE)])]
    fetcher._lookups.apply(
        fetcher._links.by_peer[peer], machine._reply(lookup, status=OK, results=results)
    )
    _finish_reads(machine)
    assert source._tasks["r2"].done and not source._tasks["r1"].done
    assert source.wants(r2, [k0]), "k0's fetch is still in flight: r2 waits for it"
    assert source.wants(r1, [k0])
    _now[0] += SAVING_RETRY_S
    fetcher._tick(_now[0])  # k0 is asked again, and is ready now
    (lookup,) = machine._lookups(peer)
    results = [("k0", OK, [(0, COLS * ITEMSIZE)])]
    fetcher._lookups.apply(
        fetcher._links.by_peer[peer], machine._reply(lookup, status=OK, results=results)
    )
    _finish_reads(machine)
    assert machine.allocator.get("k0").ready  # type: ignore[union-attr]
    assert not source.wants(r1, []) and not source.wants(r2, [])


def test_a_streaming_sessions_next_chunk_fetches_its_new_items() -> None:
    """A streaming-input session (vLLM's resumable request) keeps its request id
    across chunks, and a resumed chunk carries the media it added. Its first chunk's
    fetch is done; the next chunk's new item, which the producer holds, must be
    fetched like a new request's, not encoded here because the id's fetch is over."""
    machine = FetchMachine()
    fetcher, peer = machine.fetcher, PEERS[0]
    source = _source_over(fetcher, machine.local)
    session = _request("s1")
    session.mm_features = ["image 0"]
    assert source.wants(session, [Wanted("k0", 1, COLS)])
    lookup = _the_steps_lookup(machine, source)
    assert [key for key, _, _ in lookup.items] == ["k0"]
    results = [("k0", OK, [(0, COLS * ITEMSIZE)])]
    fetcher._lookups.apply(
        fetcher._links.by_peer[peer], machine._reply(lookup, status=OK, results=results)
    )
    _finish_reads(machine)
    assert not source.wants(session, []), "k0 landed: the first chunk runs"
    session.mm_features.append("image 1")  # the next chunk (vLLM extends the list)
    assert source.wants(session, [Wanted("k1", 1, COLS)]), "k1 is fetched for the chunk"
    lookup = _the_steps_lookup(machine, source)
    assert [key for key, _, _ in lookup.items] == ["k1"]
    results = [("k1", OK, [(BLOCK, COLS * ITEMSIZE)])]
    fetcher._lookups.apply(
        fetcher._links.by_peer[peer], machine._reply(lookup, status=OK, results=results)
    )
    _finish_reads(machine)
    assert machine.allocator.get("k1").ready  # type: ignore[union-attr]
    assert not source.wants(session, [])
    assert fetcher.counters.remote_hits == 2
    source.request_finished(session)
    source.step_done()
    assert source._tasks == {} and source._fetching == {} and source._finished == []


def test_requests_that_waited_on_a_fetch_that_failed_go_on_instead_of_fetching_again() -> None:
    """Three requests of one step need k0; r1's fetch asks for it, r2 and r3 wait for
    that fetch. Its producer is still saving k0 at the lookup deadline: the fetch
    fails, and all three encode k0 here. r2 and r3 must not start a fetch of their
    own and wait a second lookup timeout (then r3 a third: the n-th of n such
    requests waited n timeouts)."""
    machine = FetchMachine()
    fetcher, peer = machine.fetcher, PEERS[0]
    source = _source_over(fetcher, machine.local)
    k0 = Wanted("k0", 1, COLS)
    requests = [_request(f"r{i}") for i in (1, 2, 3)]
    assert all(source.wants(request, [k0]) for request in requests), "k0 is on its way"
    lookup = _the_steps_lookup(machine, source)
    saving = machine._reply(lookup, status=OK, results=[("k0", SAVING, [])])
    fetcher._lookups.apply(fetcher._links.by_peer[peer], saving)
    _now[0] += LOOKUP_S + 0.1  # the save never lands in time
    fetcher._tick(_now[0])
    assert source._tasks["r1"].done
    assert fetcher.counters.fallbacks == {"not_ready": 1}
    for request in requests:
        assert not source.wants(request, [k0]), f"{request.request_id} waits again"
    assert fetcher._intake.take(all_staged=True) == [], "no second fetch of k0"
    for request in requests:
        source.request_finished(request)
    assert source._tasks == {} and source._fetching == {} and source._finished == []


def test_an_incompatible_handle_counts_each_item_encoded_here_once() -> None:
    """A handle naming an engine incompatible with this one: its items asked of
    `ec_peers` have the fetch's own outcome (here a hit, not also a fallback); with no
    peer to ask, each item counts as an `incompatible` fallback once, however often
    the scheduler asks about the request before it runs."""
    machine = FetchMachine()
    fetcher, peer = machine.fetcher, PEERS[0]
    source = _source_over(fetcher, machine.local)
    handle = {"ec_cpu_tier": {"peer": str(PEERS[1]), "fingerprint": "other", "items": {}}}
    request = _request("r1", **handle)
    assert source.wants(request, [Wanted("k0", 1, COLS)])
    lookup = _the_steps_lookup(machine, source)
    results = [("k0", OK, [(0, COLS * ITEMSIZE)])]
    fetcher._lookups.apply(
        fetcher._links.by_peer[peer], machine._reply(lookup, status=OK, results=results)
    )
    _finish_reads(machine)
    assert not source.wants(request, [])
    counters = fetcher.counters
    assert (counters.remote_hits, counters.fallbacks) == (1, {}), "fetched: no fallback"
    alone = _source_over(_fetcher_over(None)[0], machine.local)
    alone._settings = dataclasses.replace(alone._settings, peers=())
    two = [Wanted("k2", 1, COLS), Wanted("k3", 1, COLS)]
    for _ in range(3):  # e.g. steps with no room for it
        assert not alone.wants(_request("r2", **handle), two)
    assert alone.counters.fallbacks == {"incompatible": 2}


class _NixlPostFails:
    """NIXL's own agent (what RegionAgent wraps) whose post of a READ fails the way
    its bindings report it, by raising (e.g. a connection lost between two batches
    of descriptors), while part of the READ was posted: until `holds` goes False,
    NIXL refuses to release the transfer (it may still write)."""

    holds = True

    def get_xfer_descs(self, descs: Any, mem: str) -> Any:
        return descs

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str, notify: bytes) -> Any:
        return object()

    def transfer(self, handle: Any) -> str:
        raise RuntimeError("NIXL_ERR_BACKEND")

    def check_xfer_state(self, handle: Any) -> str:
        return "ERR"

    def release_xfer_handle(self, handle: Any) -> None:
        if self.holds:
            raise RuntimeError("NIXL_IN_PROG: cannot cancel the transfer yet")


def test_a_read_whose_post_fails_but_that_nixl_keeps_holds_its_blocks_until_nixl_lets_go() -> None:
    """NIXL's bindings raise when posting a READ fails; what was posted of it may still
    write the reserved blocks if NIXL will not release the transfer. Those blocks must
    stay reserved (quarantined) until NIXL lets go, or a later entry allocated there
    is overwritten by the orphaned READ."""
    from ec_transfer_nixl.agent import RegionAgent

    machine = FetchMachine()
    fetcher, allocator, peer = machine.fetcher, machine.allocator, PEERS[0]
    nixl = _NixlPostFails()
    agent = RegionAgent.__new__(RegionAgent)
    agent._agent, agent.name, agent.metadata, agent._known = nixl, "consumer", b"md", {}
    fetcher.agent = agent
    task = _task("r0", KEYS[0])
    lookup = _asked(machine, task)
    reply = _ready_in_one_span(machine, lookup)
    fetcher._lookups.apply(fetcher._links.by_peer[peer], reply)
    fetcher._tick(_now[0])
    assert task.done and task.items[KEYS[0]].outcome != "landed"
    entry = allocator.get(KEYS[0])
    assert entry is not None and not entry.ready, "NIXL may still write: its blocks stay held"
    assert not any(isinstance(m, Release) for m in machine.sockets[peer].sent), (
        "the producer's pins stay while the READ may still read them"
    )
    nixl.holds = False
    fetcher._tick(_now[0])
    assert allocator.get(KEYS[0]) is None and fetcher.quarantined == 0
    assert any(isinstance(m, Release) for m in machine.sockets[peer].sent)


def test_a_read_nixl_refuses_at_once_counts_as_a_read_error() -> None:
    """NIXL raising as a READ is posted (nothing enqueued) fails its items as a
    `read_error` (README: "NIXL fails a READ by raising"), not as a peer that could
    not be reached, and frees the blocks reserved for it."""
    machine = FetchMachine()
    fetcher, allocator = machine.fetcher, machine.allocator

    def refuse(peer: str, pieces: Any, notify: bytes = b"") -> FakeRead:
        raise RuntimeError("NIXL_ERR_BACKEND")

    machine.agent.read = refuse  # type: ignore[method-assign]
    task = _task("r0", KEYS[0])
    lookup = _asked(machine, task)
    fetcher._lookups.apply(fetcher._links.by_peer[PEERS[0]], _ready_in_one_span(machine, lookup))
    fetcher._tick(_now[0])
    assert task.done and task.items[KEYS[0]].outcome == "read_error"
    assert allocator.get(KEYS[0]) is None


def test_a_read_within_its_fetch_deadline_is_trusted_under_any_lease_the_settings_accept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The settings accept an `ec_peer_lease_s` only above `ec_peer_fetch_timeout_s`, so
    that a fetch within its deadline is never read under a lease that ended. The
    fetcher trusts a READ only if it ended LEASE_MARGIN_S before its lease's end: a
    lease the settings accept must leave room for that, or (say a lease of 1 s) every
    fetch is read and then thrown away as a `read_error`."""
    from ec_core.peer_settings import SECRET_ENV, parse_peer_settings

    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    accepted = 0
    for fetch_s, lease_s in [(0.5, 1.0), (0.5, 1.4), (2.0, 2.5), (0.5, 1.6), (10.0, 30.0)]:
        extra = {
            "ec_peers": [str(PEERS[0])],
            "ec_peer_lookup_timeout_s": fetch_s / 2,
            "ec_peer_fetch_timeout_s": fetch_s,
            "ec_peer_lease_s": lease_s,
        }
        try:
            peers = parse_peer_settings(extra, "ec_both")
        except ValueError:
            continue
        assert peers is not None
        accepted += 1
        machine = FetchMachine()
        fetcher, peer = machine.fetcher, PEERS[0]
        task = _task("r0", KEYS[0])
        task.deadline = _now[0] + peers.fetch_timeout_s
        lookup = _asked(machine, task)
        reply = _ready_in_one_span(machine, lookup)
        reply.lease_s = peers.lease_s
        fetcher._lookups.apply(fetcher._links.by_peer[peer], reply)
        (read,) = machine.agent.running()
        _now[0] = task.deadline - 0.01  # ends within the fetch's deadline
        read.state = "DONE"
        fetcher._tick(_now[0])
        assert task.items[KEYS[0]].outcome == "landed", (fetch_s, lease_s)
    assert accepted >= 2


def test_a_shutdown_that_fails_part_way_still_closes_every_socket() -> None:
    """The thread's last act: a Release that cannot be sent (a ZMQ error other than
    EAGAIN) must not leave the links' sockets open, or the context's term() in the
    source's shutdown waits for them forever and the engine never stops."""
    machine = FetchMachine()
    fetcher = machine.fetcher
    closed_agent: list[bool] = []
    fetcher.agent.close = lambda: closed_agent.append(True)  # type: ignore[method-assign]

    def send_fails() -> None:
        raise zmq.ZMQError(zmq.EHOSTUNREACH, "a Release could not be sent")

    fetcher._releases.flush = send_fails  # type: ignore[method-assign]
    with pytest.raises(zmq.ZMQError):
        fetcher._shutdown()
    assert all(sock.closed for sock in machine.sockets.values())
    assert closed_agent == [True]


_HANDLE = {"peer": str(PEERS[1]), "fingerprint": "fp"}


@pytest.mark.parametrize(
    "params",
    [
        {"ec_cpu_tier": json.dumps(_HANDLE)},
        {"ec_cpu_tier": [str(PEERS[1])]},
        json.dumps({"ec_cpu_tier": _HANDLE}),  # e.g. through vllm_xargs, which takes text
    ],
)
def test_a_handle_that_is_not_an_object_is_ignored_with_a_warning(
    ec_log: pytest.LogCaptureFixture, params: Any
) -> None:
    """A proxy that forwards the handle mangled (e.g. as JSON text, encoded twice): its
    items are encoded here, as for any malformed handle, and the log says so. It was
    ignored without a word, so a deployment whose every handle was thrown away looked
    like one whose encoder instance held nothing."""
    fetcher, _, local = _fetcher_over(None)
    source = _source_over(fetcher, local)
    source._settings = dataclasses.replace(source._settings, peers=())
    request = _request("r1")
    request.ec_transfer_params = params
    assert not source.wants(request, [Wanted("k0", 1, COLS)]), "nothing to fetch it from"
    assert "malformed ec_transfer_params" in ec_log.text
