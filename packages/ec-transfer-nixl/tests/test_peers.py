"""Two engines' scheduler halves and CPU workers in one process, over real NIXL and ZMQ.

A producer saves entries; a consumer with `ec_peers` defers a request that
needs them, fetches them with NIXL READs into its own region, and loads them
with its ordinary worker. Then the failures: wrong secret, incompatible
peer, unreachable peer, a peer still saving, a full consumer region, and a
producer that stops in the middle.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ec_core.metadata import ECCPUConnectorMetadata
from ec_core.worker_process.ranks import RankInfo
from ec_scheduler import ECCPUScheduler
from ec_worker_cpu.worker import CpuECCPUWorker
from ectools.configs import make_vllm_config
from ectools.driving import (
    Item,
    StepDriver,
    connector_output,
    make_request,
    scheduler_output,
)
from ectools.peer_secrets import secret_keys, write_secret_file
from ectools.ports import free_port

WIDTH = 128
SECRET = "a-test-secret-0123"
WAIT_S = 60.0
"""Upper bound for a condition that normally holds within milliseconds (CI slack)."""
PATIENT = {
    "ec_peer_lookup_timeout_s": WAIT_S,
    "ec_peer_fetch_timeout_s": WAIT_S,
    "ec_peer_lease_s": 2 * WAIT_S,
}
"""Peer deadlines for a consumer whose test expects the producer to answer: the
defaults (1 s to look up) would turn a loaded CI machine's slow reply into an
`unreachable` fallback. Tests that expect no answer keep the defaults."""


def payload(key: str, rows: int, cols: int = WIDTH) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(key.encode()) * 1000 + rows)
    return torch.randn(rows, cols, generator=generator)


@dataclass
class Engine:
    """One engine's scheduler half and its one CPU worker (rank 0)."""

    scheduler: ECCPUScheduler
    worker: CpuECCPUWorker

    drop_reports: bool = False
    """Play vLLM's V1 runner on an encode-only engine: the worker's report never
    reaches the scheduler through vLLM (only through the side channel)."""

    def run_step(self, meta: ECCPUConnectorMetadata) -> dict[str, torch.Tensor]:
        """Play the worker for `meta` (saves get their key's payload, in vLLM's encoder
        cache under the item's identifier) and report back."""
        cache: dict[str, torch.Tensor] = {}
        self.worker.bind(meta)
        self.worker.start_load_caches(cache, meta)
        for key, (rows, cols) in meta.save_shapes.items():
            identifier = meta.identifiers.get(key, key)
            cache[identifier] = payload(key, rows, cols).to(self.worker.dtype)
            self.worker.save_caches(cache, identifier, meta)
        self.worker.get_finished()
        report = self.worker.build_connector_worker_meta()
        if not self.drop_reports:
            self.scheduler.update_connector_output(connector_output(report))
        return cache

    def save(self, *items: Item, salt: str | None = None) -> None:
        request = make_request("save", list(items), cache_salt=salt)
        meta = StepDriver(self.scheduler).step([request]).meta
        keys = self.scheduler.tier_keys.keys_of(request)
        assert set(meta.saves) == set(keys)
        self.run_step(meta)
        for key in keys:
            entry = self.scheduler.allocator.get(key)
            assert entry is not None and entry.ready

    def wait_available(self, request: Any) -> float:
        """Call ensure_cache_available until it stops deferring, with an empty engine step
        after each deferral (as vLLM runs them); the seconds it took."""
        began = time.monotonic()
        while not self.scheduler.ensure_cache_available(request, 0):
            assert time.monotonic() - began < WAIT_S, "a deferred request was never released"
            self.scheduler.build_connector_meta(scheduler_output(0))
            time.sleep(0.002)
        return time.monotonic() - began

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


@pytest.fixture
def make_engine(tiny_model_dir: str, tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(
        role: str,
        *,
        blocks: int = 256,
        dtype: str = "float32",
        parallel: dict[str, int] | None = None,
        widths: dict[str, int] | None = None,
        secrets: tuple[str, ...] = (SECRET,),
        **peer: Any,
    ) -> Engine:
        """`parallel`: fields of `parallel_config` to set (what vLLM sets in each engine);
        `widths`: the encoder output widths vLLM measured (default: the embedding width
        for images; `{}` for none, as on a pure consumer)."""
        region = tmp_path / f"region{len(made)}"
        region.mkdir()
        itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        extra = {"ec_cpu_bytes": blocks * WIDTH * itemsize, "ec_cpu_dir": str(region)}
        extra.update({**secret_keys(tmp_path / f"secret{len(made)}", *secrets), **peer})
        config = make_vllm_config(
            tiny_model_dir,
            role=role,
            extra=extra,
            widths={"image": WIDTH} if widths is None else widths,
            dtype=dtype,
        )
        for name, value in (parallel or {}).items():
            setattr(config.parallel_config, name, value)
        engine = Engine(ECCPUScheduler(config), CpuECCPUWorker(config, rank_info=RankInfo(0, True)))
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()


def _pair(
    make_engine: Callable[..., Engine], *, producer: dict[str, Any] | None = None, **consumer: Any
) -> tuple[Engine, Engine, str]:
    address = f"127.0.0.1:{free_port()}"
    producer_engine = make_engine("ec_both", ec_peer_listen=address, **(producer or {}))
    consumer_peers = consumer.pop("ec_peers", [address])
    return producer_engine, make_engine("ec_consumer", ec_peers=consumer_peers, **consumer), address


def _fallbacks(engine: Engine) -> dict[str, int]:
    return {
        name.split(":", 1)[1]: int(value)
        for name, value in engine.scheduler.stat_totals().items()
        if name.startswith("remote_fallbacks:")
    }


def _wait_for(condition: Callable[[], bool]) -> None:
    """Wait until `condition()` holds: it depends on another thread's progress."""
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < WAIT_S, "the condition never held"
        time.sleep(0.002)


def _wait_unpinned(producer: Engine) -> None:
    """Wait until the producer holds no entry. A consumer's release reaches the
    producer's server thread some time after its READ finished, not at a fixed
    point of a test."""
    began = time.monotonic()
    while producer.scheduler.allocator.has_held_entries():
        assert time.monotonic() - began < WAIT_S, "the producer kept its leases"
        time.sleep(0.002)


def test_a_consumer_fetches_what_a_producer_saved_and_loads_it(
    make_engine: Callable[..., Engine],
) -> None:
    producer, consumer, _ = _pair(make_engine, **PATIENT)
    items = [Item("img-a", 8), Item("img-b", 5)]
    producer.save(*items)
    request = make_request("r1", items)
    assert not consumer.scheduler.ensure_cache_available(request, 0), "deferred while fetching"
    consumer.wait_available(request)
    meta = StepDriver(consumer.scheduler).step([request]).meta
    assert set(meta.loads) == {"img-a", "img-b"} and meta.saves == {}
    cache = consumer.run_step(meta)
    for item in items:
        assert torch.equal(cache[item.identifier], payload(item.identifier, item.embeds))
    totals = consumer.scheduler.stat_totals()
    assert totals["remote_lookups"] == 2 and totals["remote_hits"] == 2
    assert totals["bytes_fetched"] == (8 + 5) * WIDTH * 4
    assert _fallbacks(consumer) == {}
    served = producer.scheduler.stat_totals()
    assert served["peer_lookups_served"] == 2
    _wait_unpinned(producer)  # the server counts the bytes just after it unpins
    _wait_for(lambda: producer.scheduler.stat_totals()["peer_bytes_served"] == (8 + 5) * WIDTH * 4)
    # Fetched once, local afterwards: the next request does not wait.
    again = make_request("r2", items)
    assert consumer.scheduler.ensure_cache_available(again, 0)


def test_request_level_handles_work_without_ec_peers(make_engine: Callable[..., Engine]) -> None:
    address = f"127.0.0.1:{free_port()}"
    producer = make_engine("ec_producer", ec_peer_listen=address)
    consumer = make_engine("ec_consumer", **PATIENT)  # a secret, no peers: handles only
    item = Item("img-h", 6)
    producer.save(item)
    finished = make_request("done", [item])
    _, params = producer.scheduler.request_finished(finished)
    assert params is not None
    handle = params["ec_cpu_tier"]
    assert handle["peer"] == address and handle["items"] == {"img-h": [6, WIDTH]}
    assert "lease" not in handle, "handles carry no lease unless ec_peer_handle_lease_s is set"
    request = make_request("r", [item])
    assert consumer.scheduler.ensure_cache_available(request, 0), "no handle: nothing to wait for"
    request = make_request("r-with-handle", [item])
    request.ec_transfer_params = params
    consumer.wait_available(request)
    cache = consumer.run_step(StepDriver(consumer.scheduler).step([request]).meta)
    assert torch.equal(cache["img-h"], payload("img-h", 6))


DEEPSTACK = {"image": 3 * WIDTH}
"""A DeepStack encoder's measured width (Qwen3-VL): the embedding and two more layers."""


def test_a_consumer_that_measured_no_width_takes_a_deepstack_producers(
    make_engine: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM measures encoder output widths on producers only. A pure consumer asks for
    any width and takes the producer's (3x the embedding here), through `ec_peers`
    and through a request's handle, and loads exactly the producer's bytes."""
    producer, consumer, _ = _pair(
        make_engine, producer={"widths": DEEPSTACK, **HANDLE_LEASES}, widths={}, **PATIENT
    )
    items = [Item("wide-a", 8), Item("wide-b", 5)]
    producer.save(*items, Item("wide-h", 6))
    for item in (*items, Item("wide-h", 6)):
        entry = producer.scheduler.allocator.get(item.identifier)
        assert entry is not None and entry.shape == (item.embeds, 3 * WIDTH)
    request = make_request("r1", items)
    consumer.wait_available(request)
    meta = StepDriver(consumer.scheduler).step([request]).meta
    assert {key: shape for key, (_, _, shape) in meta.loads.items()} == {
        "wide-a": (8, 3 * WIDTH),
        "wide-b": (5, 3 * WIDTH),
    }
    cache = consumer.run_step(meta)
    for item in items:
        assert torch.equal(cache[item.identifier], payload(item.identifier, item.embeds, 3 * WIDTH))
    handled = make_request("r-handle", [Item("wide-h", 6)])
    handled.ec_transfer_params = _handle_of(producer, Item("wide-h", 6))
    consumer.wait_available(handled)
    cache = consumer.run_step(StepDriver(consumer.scheduler).step([handled]).meta)
    assert torch.equal(cache["wide-h"], payload("wide-h", 6, 3 * WIDTH))
    assert _fallbacks(consumer) == {}
    assert consumer.scheduler.stat_totals()["bytes_fetched"] == (8 + 5 + 6) * 3 * WIDTH * 4
    assert "holds item" not in caplog.text


def test_a_width_that_is_no_multiple_of_the_embedding_or_other_rows_is_encoded_with_a_warning(
    make_engine: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """A peer whose entry cannot be this engine's encoder output (a width that is not a
    whole multiple of the embedding width; another row count: a reused UUID) is not
    read: the item is encoded here, counted under `shape`, and the log says why."""
    producer, consumer, _ = _pair(
        make_engine, producer={"widths": {"image": WIDTH + 16}}, widths={}, **PATIENT
    )
    producer.save(Item("odd", 4))
    consumer.wait_available(make_request("r1", [Item("odd", 4)]))
    assert _fallbacks(consumer) == {"shape": 1}
    assert f"holds item odd as 4 x {WIDTH + 16}" in caplog.text
    assert "needs 4 rows (its placeholder's embeddings) of any width" in caplog.text
    other, consumer2, _ = _pair(make_engine, **PATIENT)
    other.save(Item("reused", 4))
    caplog.clear()
    consumer2.wait_available(make_request("r2", [Item("reused", 6)]))
    assert _fallbacks(consumer2) == {"shape": 1}
    assert f"holds item reused as 4 x {WIDTH}, but this engine needs 6 rows" in caplog.text
    for engine in (consumer, consumer2):
        assert not engine.scheduler.allocator.has_held_entries()
    _wait_unpinned(producer)
    _wait_unpinned(other)


def _free_ports(count: int) -> int:
    """The first of `count` consecutive free ports on 127.0.0.1."""
    for _ in range(100):
        first = free_port()
        with contextlib.ExitStack() as probes:
            try:
                for port in range(first, first + count):
                    probe = probes.enter_context(socket.socket())
                    probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return first
    raise AssertionError(f"no {count} consecutive free ports")


def _dp_engine(index: int, *, moe: bool) -> dict[str, int]:
    """The parallel fields vLLM sets in data-parallel engine `index` of 2: a MoE model's
    engines keep their rank, a dense model's each run as DP=1 (rank 0, size 1) and
    only `data_parallel_index` tells them apart."""
    if moe:
        return {"data_parallel_index": index, "data_parallel_rank": index, "data_parallel_size": 2}
    return {"data_parallel_index": index, "data_parallel_rank": 0, "data_parallel_size": 1}


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_the_engines_of_a_data_parallel_producer_each_listen_on_their_own_port(
    make_engine: Callable[..., Engine], moe: bool
) -> None:
    """Every engine of a data-parallel deployment gets the same ec_peer_listen and
    bound it: the second engine's start failed (address already in use), so a
    producer could not run with --data-parallel-size > 1. Engine k listens on
    PORT + k, and its handles name that address."""
    first = _free_ports(2)
    listen = f"127.0.0.1:{first}"
    producers = [
        make_engine("ec_producer", ec_peer_listen=listen, parallel=_dp_engine(k, moe=moe))
        for k in range(2)
    ]
    addresses = [f"127.0.0.1:{first + k}" for k in range(2)]
    consumer = make_engine("ec_consumer", ec_peers=addresses, **PATIENT)
    items = [Item("img-dp0", 4), Item("img-dp1", 6)]
    for producer, item in zip(producers, items, strict=True):
        producer.save(item)
    request = make_request("r-dp", items)
    consumer.wait_available(request)
    cache = consumer.run_step(StepDriver(consumer.scheduler).step([request]).meta)
    for item in items:
        assert torch.equal(cache[item.identifier], payload(item.identifier, item.embeds))
    assert _fallbacks(consumer) == {}
    # Each one served its own item, from its own port.
    _wait_for(lambda: all(p.scheduler.stat_totals()["peer_bytes_served"] > 0 for p in producers))
    # A handle names the address its engine listens on: a consumer without ec_peers
    # follows it there.
    _, params = producers[1].scheduler.request_finished(make_request("done-dp", items[1:]))
    assert params is not None and params["ec_cpu_tier"]["peer"] == addresses[1]
    by_handle = make_engine("ec_consumer", **PATIENT)
    again = make_request("r-dp-handle", items[1:])
    again.ec_transfer_params = params
    by_handle.wait_available(again)
    cache = by_handle.run_step(StepDriver(by_handle.scheduler).step([again]).meta)
    assert torch.equal(cache["img-dp1"], payload("img-dp1", 6))
    assert _fallbacks(by_handle) == {}


def test_the_ec_both_engines_of_a_data_parallel_deployment_share_one_peer_list(
    make_engine: Callable[..., Engine],
) -> None:
    """`ec_both` engines of one data-parallel deployment share one config: an
    `ec_peers` naming all of them names each engine itself too. It was refused
    ("lists this engine's own ec_peer_listen"); each engine now asks the others."""
    first = _free_ports(2)
    shared = {
        "ec_peer_listen": f"127.0.0.1:{first}",
        "ec_peers": [f"127.0.0.1:{first + k}" for k in range(2)],
        **PATIENT,
    }
    engines = [
        make_engine("ec_both", parallel=_dp_engine(k, moe=False), **shared) for k in range(2)
    ]
    for k, engine in enumerate(engines):
        source = engine.scheduler.remote
        assert source is not None
        assert [str(p) for p in source._settings.peers] == [f"127.0.0.1:{first + 1 - k}"]  # type: ignore[attr-defined]
    engines[0].save(Item("img-sib", 5))
    request = make_request("r-sib", [Item("img-sib", 5)])
    engines[1].wait_available(request)
    cache = engines[1].run_step(StepDriver(engines[1].scheduler).step([request]).meta)
    assert torch.equal(cache["img-sib"], payload("img-sib", 5))
    assert _fallbacks(engines[1]) == {}


def test_peers_and_handles_work_over_ipv6_loopback(make_engine: Callable[..., Engine]) -> None:
    """An IPv6 literal was accepted by the settings but never reached: the server
    bound, and the fetcher connected, to `tcp://::1:PORT`, which ZeroMQ cannot read."""
    address = f"[::1]:{free_port('::1')}"
    producer = make_engine(
        "ec_both", ec_peer_listen=address, ec_peer_handle_lease_s=WAIT_S, **PATIENT
    )
    by_peers = make_engine("ec_consumer", ec_peers=[address], **PATIENT)
    by_handle = make_engine("ec_consumer", **PATIENT)
    items = [Item("img-6a", 4), Item("img-6b", 7)]
    producer.save(*items)
    request = make_request("r6", items[:1])
    by_peers.wait_available(request)
    cache = by_peers.run_step(StepDriver(by_peers.scheduler).step([request]).meta)
    assert torch.equal(cache["img-6a"], payload("img-6a", 4))
    assert _fallbacks(by_peers) == {}
    _, params = producer.scheduler.request_finished(make_request("done6", items[1:]))
    assert params is not None and params["ec_cpu_tier"]["peer"] == address
    request = make_request("r6-handle", items[1:])
    request.ec_transfer_params = params
    by_handle.wait_available(request)
    cache = by_handle.run_step(StepDriver(by_handle.scheduler).step([request]).meta)
    assert torch.equal(cache["img-6b"], payload("img-6b", 7))
    assert _fallbacks(by_handle) == {}


def test_a_listen_address_in_use_is_a_clear_error_not_a_hung_start(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    """The server thread left its socket open when bind failed, so the source's
    cleanup (ZeroMQ's context.term()) waited for it forever: a port in use hung
    the engine's start instead of failing it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        outcome: list[BaseException | None] = []

        def start() -> None:
            try:
                make_engine("ec_producer", ec_peer_listen=address)
            except BaseException as exc:  # the outcome is checked below
                outcome.append(exc)
            else:
                outcome.append(None)

        starter = threading.Thread(target=start, daemon=True)
        starter.start()
        starter.join(WAIT_S)
        assert not starter.is_alive(), "the engine's start hung"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)
    assert f"cannot serve peers on {address}" in str(outcome[0])
    assert list((tmp_path / "region0").iterdir()) == [], "the region file stayed behind"


def test_finished_requests_leave_nothing_in_the_consumers_fetch_index(
    make_engine: Callable[..., Engine],
) -> None:
    """Every fetched item was kept in the consumer's index of fetches in flight for
    the engine's life: memory grew with every image ever fetched."""
    producer, consumer, _ = _pair(make_engine, **PATIENT)
    items = [Item(f"img-{i}", 3) for i in range(4)]
    producer.save(*items)
    source = consumer.scheduler.remote
    assert source is not None
    for i, item in enumerate(items):
        request = make_request(f"r{i}", [item])
        consumer.wait_available(request)
        consumer.run_step(StepDriver(consumer.scheduler).step([request]).meta)
        consumer.scheduler.request_finished(request)
    assert source._fetching == {} and source._finished == []  # type: ignore[attr-defined]
    # A request finished (aborted) while its fetch still runs: kept until it is done.
    unreachable = make_engine("ec_consumer", ec_peers=[f"127.0.0.1:{free_port()}"])
    source = unreachable.scheduler.remote
    assert source is not None
    aborted = make_request("aborted", [Item("img-x", 3)])
    with _between_passes(_fetcher(unreachable)):  # its fetch cannot end meanwhile
        assert not unreachable.scheduler.ensure_cache_available(aborted, 0)
        unreachable.scheduler.request_finished(aborted)
        assert "img-x" in source._fetching  # type: ignore[attr-defined]
    other = make_request("other", [Item("img-y", 3)])
    unreachable.wait_available(other)  # steps go on
    _wait_for(lambda: all(task.done for task in source._finished))  # type: ignore[attr-defined]
    unreachable.scheduler.request_finished(other)
    assert source._fetching == {} and source._finished == []  # type: ignore[attr-defined]


def _fetcher(engine: Engine) -> Any:
    return engine.scheduler.remote.fetcher  # type: ignore[union-attr]


@contextlib.contextmanager
def _between_passes(fetcher: Any) -> Iterator[None]:
    """Hold the fetcher thread between two of its passes: whatever is handed to it
    meanwhile is taken on by one pass (its idle poll could otherwise end in the
    middle of a step's hand-over, however short)."""
    gate, arrived = threading.Lock(), threading.Event()
    one_pass = fetcher._loop_once

    def gated() -> None:
        arrived.set()
        with gate:
            one_pass()

    with gate:  # held before the thread can come to it: it stops there
        fetcher._loop_once = gated
        try:
            assert arrived.wait(WAIT_S), "the fetcher thread never came round"
            yield
        finally:
            fetcher._loop_once = one_pass


HANDLE_LEASES = {"ec_peer_handle_lease_s": WAIT_S, "ec_peer_lease_s": 2 * WAIT_S}
"""A producer whose handles a test expects read at once: a handle within
HANDLE_TTL_MARGIN_S of its end is looked up instead, so a short lease would let a
loaded machine's slow steps decide how it is fetched."""


def _handle_of(producer: Engine, item: Item) -> dict[str, Any]:
    _, params = producer.scheduler.request_finished(make_request(f"done-{item.identifier}", [item]))
    assert params is not None and "lease" in params["ec_cpu_tier"]
    return params


def test_a_handle_lease_is_read_at_once_by_a_consumer_that_knows_the_producer(
    make_engine: Callable[..., Engine],
) -> None:
    """The READ starts before any answer; the claim confirms the lease; the bytes land.
    Then a handle claimed already, one signed with another secret and one whose lease
    expired: each is looked up as usual, and lands correct."""
    producer, consumer, _ = _pair(make_engine, producer=HANDLE_LEASES, **PATIENT)
    first, item = Item("img-first", 4), Item("img-fast", 6)
    producer.save(first, item)
    consumer.wait_available(make_request("r0", [first]))  # learns the producer's agent
    params = _handle_of(producer, item)
    request = make_request("r", [item])
    request.ec_transfer_params = params
    consumer.wait_available(request)
    assert _fetcher(consumer).handle_reads == 1, "read before the claim's answer"
    cache = consumer.run_step(StepDriver(consumer.scheduler).step([request]).meta)
    assert torch.equal(cache["img-fast"], payload("img-fast", 6))
    assert _fallbacks(consumer) == {}
    _wait_unpinned(producer)

    ids = iter(range(1_000))

    def fetch_again(key: str, params: dict[str, Any]) -> None:
        with consumer.scheduler.lock:
            consumer.scheduler.allocator.drop(key)
        again = make_request(f"again-{next(ids)}", [Item(key, 6)])  # a new request each time
        again.ec_transfer_params = params
        consumer.wait_available(again)
        cache = consumer.run_step(StepDriver(consumer.scheduler).step([again]).meta)
        assert torch.equal(cache[key], payload(key, 6))
        assert _fallbacks(consumer) == {}

    fetch_again("img-fast", params)  # claimed (and released) before: lapsed
    assert _fetcher(consumer).handle_reads == 2, "read at once, then thrown away"
    _wait_unpinned(producer)
    forged = _handle_of(producer, item)
    forged["ec_cpu_tier"]["lease"]["spans"]["img-fast"] = [[0, 6 * WIDTH * 4]]
    fetch_again("img-fast", forged)
    assert _fetcher(consumer).handle_reads == 2, "a forged handle is not read"
    producer.scheduler.remote.server.handle_lease_s = 0.2  # type: ignore[union-attr]
    expiring = _handle_of(producer, item)
    fetch_again("img-fast", expiring)
    assert _fetcher(consumer).handle_reads == 2, "nor one about to expire"
    # The handle leases nobody claimed go when they expire, not before: here they are
    # still pinned; stopping the producer releases every lease it holds.
    producer.scheduler.shutdown()
    assert not producer.scheduler.allocator.has_held_entries()


def test_a_steps_handles_are_read_with_one_read_and_one_lapsed_lease_is_looked_up(
    make_engine: Callable[..., Engine],
) -> None:
    """Four requests deferred in one step, each with its handle's lease at the same
    producer: one claim and one READ for all of them. One of the leases was claimed
    before (by another request): its bytes are dropped and its item looked up; every
    item lands correct, and the producer ends with nothing pinned."""
    producer, consumer, _ = _pair(make_engine, producer=HANDLE_LEASES, **PATIENT)
    first = Item("img-warm", 4)
    items = [Item(f"img-batch-{i}", 3 + i) for i in range(4)]
    producer.save(first, *items)
    consumer.wait_available(make_request("r0", [first]))  # learns the producer's agent
    handles = [_handle_of(producer, item) for item in items]
    claimed_before = make_request("claimed-before", [items[2]])
    claimed_before.ec_transfer_params = handles[2]
    consumer.wait_available(claimed_before)
    with consumer.scheduler.lock:
        consumer.scheduler.allocator.drop(items[2].identifier)
    reads, batches = _fetcher(consumer).handle_reads, _fetcher(consumer).handle_batches
    requests = []
    for i, (item, params) in enumerate(zip(items, handles, strict=True)):
        request = make_request(f"r-batch-{i}", [item])
        request.ec_transfer_params = params
        requests.append(request)
    began = time.monotonic()
    with _between_passes(_fetcher(consumer)):  # the step's four tasks reach one pass
        waiting = [r for r in requests if not consumer.scheduler.ensure_cache_available(r, 0)]
    assert len(waiting) == 4, "all four deferred in one step"
    while waiting:
        assert time.monotonic() - began < WAIT_S, "a deferred request was never released"
        consumer.scheduler.build_connector_meta(scheduler_output(0))
        time.sleep(0.002)
        waiting = [r for r in waiting if not consumer.scheduler.ensure_cache_available(r, 0)]
    assert _fetcher(consumer).handle_reads - reads == 4, "all read before the claim's answer"
    assert _fetcher(consumer).handle_batches - batches == 1, "with one READ"
    cache = consumer.run_step(StepDriver(consumer.scheduler).step(requests).meta)
    for item in items:
        assert torch.equal(cache[item.identifier], payload(item.identifier, item.embeds))
    assert _fallbacks(consumer) == {}
    _wait_unpinned(producer)


def test_a_wrong_secret_gets_nothing(
    make_engine: Callable[..., Engine], ec_log: pytest.LogCaptureFixture
) -> None:
    producer, consumer, _ = _pair(make_engine, secrets=("another-secret-9876",))
    producer.save(Item("img-s", 4))
    request = make_request("r", [Item("img-s", 4)])
    consumer.wait_available(request)
    meta = StepDriver(consumer.scheduler).step([request]).meta
    assert meta.loads == {}, "encoded locally"
    assert _fallbacks(consumer) == {"unreachable": 1}
    # The producer drops the unsigned lookup on its own thread, without a reply.
    _wait_for(lambda: producer.scheduler.stat_totals()["peer_requests_denied"] >= 1)
    _wait_for(lambda: any("not signed" in r.getMessage() for r in ec_log.records))
    assert producer.scheduler.stat_totals()["peer_lookups_served"] == 0
    assert not producer.scheduler.allocator.has_held_entries(), "no pin for a stranger"
    assert any("is not asked for" in r.getMessage() for r in ec_log.records)


def test_an_incompatible_peer_is_not_read(
    make_engine: Callable[..., Engine], ec_log: pytest.LogCaptureFixture
) -> None:
    address = f"127.0.0.1:{free_port()}"
    producer = make_engine("ec_both", ec_peer_listen=address, dtype="bfloat16")
    consumer = make_engine("ec_consumer", ec_peers=[address], **PATIENT)
    producer.save(Item("img-i", 4))
    request = make_request("r", [Item("img-i", 4)])
    consumer.wait_available(request)
    assert _fallbacks(consumer) == {"incompatible": 1}
    assert any("incompatible engine" in r.getMessage() for r in ec_log.records)
    later = make_request("r2", [Item("img-j", 4)])
    consumer.wait_available(later)
    assert _fallbacks(consumer) == {"incompatible": 2}, "not asked again"
    assert producer.scheduler.stat_totals()["peer_lookups_served"] == 0


def test_an_unreachable_peer_fails_fast_and_is_left_alone(
    make_engine: Callable[..., Engine], ec_log: pytest.LogCaptureFixture
) -> None:
    """Fast: given up at the lookup deadline (the default 1 s), not the fetch deadline,
    which is set far past `wait_available`'s WAIT_S bound so waiting for it would fail
    the test (no wall-clock threshold of its own). Left alone: marked down, said once."""
    address = f"127.0.0.1:{free_port()}"
    consumer = make_engine(
        "ec_consumer",
        ec_peers=[address],
        ec_peer_fetch_timeout_s=10 * WAIT_S,
        ec_peer_lease_s=20 * WAIT_S,
    )
    request = make_request("r", [Item("img-u", 4)])
    consumer.wait_available(request)
    assert _fallbacks(consumer) == {"unreachable": 1}
    down = [r.getMessage() for r in ec_log.records if "is not asked for" in r.getMessage()]
    assert len(down) == 1 and address in down[0], "the silent peer is marked down"
    meta = StepDriver(consumer.scheduler).step([request]).meta
    assert meta.loads == {}
    assert not consumer.scheduler.allocator.has_held_entries()


def test_a_fetcher_thread_that_dies_on_a_bug_leaves_no_request_waiting(
    make_engine: Callable[..., Engine], ec_log: pytest.LogCaptureFixture
) -> None:
    """An unexpected error in the fetcher thread (a bug: a peer's faults are handled
    where they happen) fails its open fetches and stops fetching: the request that
    was waiting goes on, later ones do not wait at all, and the error is logged."""
    consumer = make_engine("ec_both", ec_peers=[f"127.0.0.1:{free_port()}"], **PATIENT)
    fetcher = _fetcher(consumer)
    first = make_request("r1", [Item("img-1", 4)])
    with _between_passes(fetcher):
        assert not consumer.scheduler.ensure_cache_available(first, 0), "deferred: fetching"

        def broken(now: float) -> None:
            raise RuntimeError("injected bug")

        fetcher._tick = broken
        consumer.scheduler.build_connector_meta(scheduler_output(0))  # kicks the step's tasks
    consumer.wait_available(first)  # failed by the dying thread: no lookup deadline needed
    _wait_for(lambda: not fetcher._thread.is_alive())
    assert not fetcher.running
    later = make_request("r2", [Item("img-2", 4)])
    assert consumer.scheduler.ensure_cache_available(later, 0), "nothing to wait for now"
    meta = StepDriver(consumer.scheduler).step([first, later]).meta
    assert set(meta.saves) == {"img-1", "img-2"}, "both are encoded and saved here"
    assert meta.loads == {}
    assert any("stopped on an unexpected error" in r.getMessage() for r in ec_log.records)


def test_a_step_that_ends_after_the_consumer_shut_down_does_not_raise(
    make_engine: Callable[..., Engine],
) -> None:
    consumer = make_engine("ec_consumer", ec_peers=[f"127.0.0.1:{free_port()}"])
    assert not consumer.scheduler.ensure_cache_available(make_request("r", [Item("i", 4)]), 0)
    consumer.scheduler.shutdown()  # the fetcher stops with the request's task unread
    consumer.scheduler.build_connector_meta(scheduler_output(0))  # the step ends: no raise


def test_missing_items_and_a_full_consumer_region_fall_back(
    make_engine: Callable[..., Engine],
) -> None:
    address = f"127.0.0.1:{free_port()}"
    producer = make_engine("ec_both", ec_peer_listen=address)
    consumer = make_engine("ec_consumer", ec_peers=[address], blocks=8, **PATIENT)
    producer.save(Item("big", 16))
    consumer.wait_available(make_request("r1", [Item("nowhere", 4)]))
    assert _fallbacks(consumer) == {"missing": 1}
    consumer.wait_available(make_request("r2", [Item("big", 16)]))
    assert _fallbacks(consumer) == {"missing": 1, "no_space": 1}
    assert not consumer.scheduler.allocator.has_held_entries()
    began = time.monotonic()
    while producer.scheduler.allocator.num_held_entries:
        assert time.monotonic() - began < WAIT_S, "the producer kept the unread lease"
        time.sleep(0.005)


def test_an_item_still_being_saved_is_fetched_once_ready(
    make_engine: Callable[..., Engine],
) -> None:
    """The producer answers "saving" until its save lands; the consumer keeps asking
    (within a lookup timeout long enough for the test) and then fetches it."""
    address = f"127.0.0.1:{free_port()}"
    producer = make_engine("ec_both", ec_peer_listen=address)
    consumer = make_engine(
        "ec_consumer",
        ec_peers=[address],
        ec_peer_lookup_timeout_s=WAIT_S,
        ec_peer_fetch_timeout_s=WAIT_S,
        ec_peer_lease_s=2 * WAIT_S,
    )
    item = Item("img-late", 4)
    meta = StepDriver(producer.scheduler).step([make_request("save", [item])]).meta
    request = make_request("r", [item])
    assert not consumer.scheduler.ensure_cache_available(request, 0)
    began = time.monotonic()
    while not producer.scheduler.stat_totals()["peer_lookups_not_ready"]:
        assert time.monotonic() - began < WAIT_S, "the producer never answered"
        time.sleep(0.002)
    assert not consumer.scheduler.ensure_cache_available(request, 0), "still waiting"
    producer.run_step(meta)  # now the save lands
    consumer.wait_available(request)
    assert _fallbacks(consumer) == {}
    cache = consumer.run_step(StepDriver(consumer.scheduler).step([request]).meta)
    assert torch.equal(cache["img-late"], payload("img-late", 4))


def test_a_peer_still_saving_at_the_lookup_deadline_is_not_taken_for_down(
    make_engine: Callable[..., Engine],
) -> None:
    """An item still being saved when the lookup deadline passes is encoded here
    (cause not_ready); the peer answered, so it is asked again for the next item.

    The deadline is moved to now once the consumer has heard "saving": a lookup
    timeout short enough to pass during the test would also make a reply slowed
    by a loaded machine miss it (an `unreachable` fallback, the peer marked down)."""
    address = f"127.0.0.1:{free_port()}"
    producer = make_engine("ec_both", ec_peer_listen=address)
    consumer = make_engine("ec_consumer", ec_peers=[address], **PATIENT)
    item = Item("img-slow", 4)
    meta = StepDriver(producer.scheduler).step([make_request("save", [item])]).meta
    first = make_request("r1", [item])
    assert not consumer.scheduler.ensure_cache_available(first, 0)
    consumer.scheduler.build_connector_meta(scheduler_output(0))  # hands the task over
    task = consumer.scheduler.remote._tasks["r1"]  # type: ignore[union-attr]
    _wait_for(lambda: bool(task.items["img-slow"].heard))  # the peer answered "saving"
    assert not task.done, "still waiting for the save"
    task.lookup_deadline = time.monotonic()  # the save never lands in time
    consumer.wait_available(first)
    assert _fallbacks(consumer) == {"not_ready": 1}
    producer.run_step(meta)
    request = make_request("r2", [item])
    consumer.wait_available(request)
    assert _fallbacks(consumer) == {"not_ready": 1}, "fetched: the peer was not marked down"
    cache = consumer.run_step(StepDriver(consumer.scheduler).step([request]).meta)
    assert torch.equal(cache["img-slow"], payload("img-slow", 4))


def test_a_request_that_waited_on_a_failed_fetch_is_encoded_not_fetched_again(
    make_engine: Callable[..., Engine],
) -> None:
    """Two requests need an item the producer is still saving at the lookup deadline:
    r1's fetch asks for it and r2 waits for that fetch. Once it fails, both encode
    the item here; r2 must not start a fetch of its own and wait a whole lookup
    timeout more (with n such requests the last waited n timeouts)."""
    address = f"127.0.0.1:{free_port()}"
    producer = make_engine("ec_both", ec_peer_listen=address)
    consumer = make_engine("ec_consumer", ec_peers=[address], **PATIENT)
    item = Item("img-stuck", 4)
    StepDriver(producer.scheduler).step([make_request("save", [item])])  # never lands
    first, second = make_request("r1", [item]), make_request("r2", [item])
    assert not consumer.scheduler.ensure_cache_available(first, 0)
    assert not consumer.scheduler.ensure_cache_available(second, 0), "waits for r1's fetch"
    consumer.scheduler.build_connector_meta(scheduler_output(0))  # hands the task over
    source = consumer.scheduler.remote
    task = source._tasks["r1"]  # type: ignore[union-attr]
    _wait_for(lambda: bool(task.items["img-stuck"].heard))  # the peer answered "saving"
    task.lookup_deadline = time.monotonic()  # the save never lands in time
    consumer.wait_available(first)
    assert _fallbacks(consumer) == {"not_ready": 1}
    assert consumer.scheduler.ensure_cache_available(second, 0), "r2 waited once: encoded here"
    meta = StepDriver(consumer.scheduler).step([first, second]).meta
    assert meta.loads == {} and not consumer.scheduler.allocator.has_held_entries()
    assert consumer.scheduler.stat_totals()["remote_lookups"] == 1, "asked for once"


def test_an_encode_only_producer_whose_reports_vllm_drops_still_serves(
    make_engine: Callable[..., Engine],
) -> None:
    """vLLM 0.32's V1 runner drops an ec_producer's worker reports; they arrive on
    the side channel, so its saves become ready and consumers fetch them."""
    address = f"127.0.0.1:{free_port()}"
    producer = make_engine("ec_producer", ec_peer_listen=address)
    producer.drop_reports = True
    consumer = make_engine("ec_consumer", ec_peers=[address], **PATIENT)
    item = Item("img-encoded", 6)
    producer.run_step(StepDriver(producer.scheduler).step([make_request("save", [item])]).meta)
    request = make_request("r", [item])
    consumer.wait_available(request)
    assert _fallbacks(consumer) == {}
    cache = consumer.run_step(StepDriver(consumer.scheduler).step([request]).meta)
    assert torch.equal(cache["img-encoded"], payload("img-encoded", 6))
    entry = producer.scheduler.allocator.get("img-encoded")
    assert entry is not None and entry.ready
    _wait_unpinned(producer)


def test_a_producer_that_stops_leaves_the_consumer_correct_and_clean(
    make_engine: Callable[..., Engine],
) -> None:
    producer, consumer, _ = _pair(make_engine)
    producer.save(Item("img-x", 4))
    producer.scheduler.shutdown()  # its server stops answering
    request = make_request("r", [Item("img-x", 4)])
    consumer.wait_available(request)
    fallbacks = _fallbacks(consumer)
    assert sum(fallbacks.values()) == 1 and set(fallbacks) <= {"unreachable", "timeout"}
    assert not consumer.scheduler.allocator.has_held_entries()
    assert StepDriver(consumer.scheduler).step([request]).meta.loads == {}


def test_no_transport_module_is_imported_without_peer_keys(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys
        from ec_scheduler import ECCPUScheduler
        from ectools.configs import make_vllm_config
        config = make_vllm_config({tiny_model_dir!r}, extra={{"ec_cpu_bytes": "1MiB",
            "ec_cpu_dir": {str(tmp_path)!r}}}, widths={{"image": 128}})
        ECCPUScheduler(config).shutdown()
        print(sorted(m for m in ("zmq", "msgspec", "nixl", "nixl_cu12", "ec_transfer_nixl")
                     if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    # vLLM itself imports zmq and msgspec; ours must add neither NIXL nor the layer.
    loaded = out.stdout.strip().splitlines()[-1]
    assert "nixl" not in loaded and "ec_transfer_nixl" not in loaded
    # And the layer's package itself (what its entry point loads) imports none of them.
    probe = "import sys, ec_transfer_nixl; print(sorted(m for m in sys.modules if m in "
    probe += "('zmq', 'msgspec', 'nixl', 'nixl_cu12', 'torch', 'vllm')))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def test_a_peer_thread_that_does_not_stop_keeps_the_region_mapped(
    make_engine: Callable[..., Engine], ec_log: pytest.LogCaptureFixture
) -> None:
    """A thread that did not stop in time may still have NIXL READ into (or serve from)
    the region: unmapping it then could crash the process, so the mapping stays until
    the process exits, and the operator is told."""
    consumer = make_engine("ec_consumer", ec_peers=[f"127.0.0.1:{free_port()}"])
    source = consumer.scheduler.remote
    fetcher = _fetcher(consumer)
    stop = fetcher.stop
    fetcher.stop = lambda: False  # type: ignore[method-assign]  # hung past its 10 s
    try:
        consumer.scheduler.shutdown()
        assert not source._region.closed, "unmapped under a thread that may still use it"
        assert any("did not stop in time" in r.getMessage() for r in ec_log.records)
    finally:
        assert stop()
        source._context.term()
        source._region.cleanup()


def test_a_read_nixl_never_released_keeps_the_region_mapped(
    make_engine: Callable[..., Engine],
    ec_log: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A READ still quarantined when the fetcher stops (NIXL would not let go of it) may
    still write into the region: the source's shutdown leaves the mapping alone."""
    consumer = make_engine("ec_consumer", ec_peers=[f"127.0.0.1:{free_port()}"])
    source = consumer.scheduler.remote
    fetcher = _fetcher(consumer)
    monkeypatch.setattr(type(fetcher), "quarantined", property(lambda self: 1))
    try:
        consumer.scheduler.shutdown()
        assert not fetcher._thread.is_alive()
        assert not source._region.closed, "unmapped under a READ NIXL still holds"
        assert any("1 READ(s) NIXL never released" in r.getMessage() for r in ec_log.records)
    finally:
        source._region.cleanup()


def test_a_handle_issued_before_a_weight_update_is_not_served_after_it(
    make_engine: Callable[..., Engine],
) -> None:
    """A producer issues a handle (its lease pins the entry), then vLLM resets its
    encoder cache (new weights): a consumer claiming that handle afterwards must not
    keep the bytes it READ at once: the claim answers LAPSED, the item is looked up
    (missing now) and encoded on the consumer."""
    producer, consumer, _ = _pair(make_engine, producer=HANDLE_LEASES, **PATIENT)
    first, item = Item("img-known", 4), Item("img-old", 6)
    producer.save(first, item)
    consumer.wait_available(make_request("r0", [first]))  # learns the producer's agent
    params = _handle_of(producer, item)
    producer.scheduler.invalidate()  # what vLLM's reset_encoder_cache now leads to
    request = make_request("r", [item])
    request.ec_transfer_params = params
    consumer.wait_available(request)
    assert _fetcher(consumer).handle_reads == 1, "read at once, before the claim's answer"
    assert StepDriver(consumer.scheduler).step([request]).looked_up == {"img-old": False}
    _wait_unpinned(producer)
    assert producer.scheduler.allocator.get("img-old") is None, "dropped once let go of"


@pytest.mark.parametrize("status", ["FINISHED_ABORTED", "FINISHED_ERROR"])
def test_a_request_aborted_or_failed_on_the_producer_pins_nothing_for_a_handle(
    make_engine: Callable[..., Engine], status: str
) -> None:
    """vLLM throws away what `request_finished` returns for a request it aborts (a
    client gone, a proxy's timeout) or fails: a handle lease granted for one could
    never be claimed, yet pinned its entries for all of `ec_peer_handle_lease_s`.
    Under a burst of aborts that fills the region with pinned entries, and the
    producer's new encoder outputs find no room to be saved."""
    from vllm.v1.request import RequestStatus

    address = f"127.0.0.1:{free_port()}"
    producer = make_engine("ec_producer", blocks=16, ec_peer_listen=address, **HANDLE_LEASES)
    items = [Item(f"img-aborted-{i}", 4) for i in range(4)]  # the whole region
    producer.save(*items)
    aborted = make_request("aborted", items)
    aborted.status = getattr(RequestStatus, status)
    _, params = producer.scheduler.request_finished(aborted)
    assert params is None, "no handle for an output vLLM drops"
    assert not producer.scheduler.allocator.has_held_entries(), "nothing pinned for it"
    producer.save(Item("img-next", 4))  # room by evicting one of them


# ------------------------------------------------- items given by metadata alone


def _metadata_only(request: Any) -> Any:
    """`request` with each item given by metadata alone (no input for the encoder),
    as an EC consumer's vLLM accepts them (pre-computed embeddings without the tensor)."""
    for feature in request.mm_features:
        feature.data = None
    return request


def _settle(engine: Engine, request: Any) -> bool:
    """What vLLM's steps make of `request`: ensure_cache_available until it stops
    deferring (True), or until the request is handed over as unavailable and vLLM
    fails it (False: `request_finished` with the error status, as vLLM calls it)."""
    from vllm.v1.request import RequestStatus

    began = time.monotonic()
    while not engine.scheduler.ensure_cache_available(request, 0):
        if request.request_id in engine.scheduler.take_unavailable_requests():
            request.status = RequestStatus.FINISHED_ERROR
            engine.scheduler.request_finished(request)
            engine.scheduler.build_connector_meta(scheduler_output(0))
            return False
        assert time.monotonic() - began < WAIT_S, "a request was deferred for ever"
        engine.scheduler.build_connector_meta(scheduler_output(0))
        time.sleep(0.002)
    assert engine.scheduler.take_unavailable_requests() == set()
    return True


def _with_failed_read(producer: Engine, consumer: Engine, item: Item, monkeypatch: Any) -> None:
    """NIXL reports the READ failed (as when the producer goes away mid-READ)."""
    producer.save(item)
    monkeypatch.setattr(_fetcher(consumer).agent, "state", lambda handle: "ERR")


def _with_stuck_read(producer: Engine, consumer: Engine, item: Item, monkeypatch: Any) -> None:
    """The READ never finishes (NIXL keeps saying PROC); its deadline is moved to now
    once it runs (a fetch timeout short enough to pass here would also cut a lookup
    slowed by a loaded machine)."""
    producer.save(item)
    fetcher = _fetcher(consumer)
    monkeypatch.setattr(fetcher.agent, "state", lambda handle: "PROC")

    def expire() -> None:
        _wait_for(lambda: bool(fetcher._reads.running))
        for group in list(fetcher._reads.running):
            group.deadline = time.monotonic()

    threading.Thread(target=expire, daemon=True).start()


_FAILED_FETCHES: dict[str, tuple[dict[str, Any], dict[str, Any], int, Any]] = {
    # cause: (producer settings, consumer settings, rows, what to do before asking)
    "missing": ({}, PATIENT, 4, None),
    "read_error": ({}, PATIENT, 4, _with_failed_read),
    "timeout": ({}, PATIENT, 4, _with_stuck_read),
    "incompatible": ({"dtype": "bfloat16"}, PATIENT, 4, None),
    "no_space": ({}, {"blocks": 8, **PATIENT}, 16, None),
}


@pytest.mark.parametrize("cause", sorted(_FAILED_FETCHES))
def test_an_item_without_input_whose_fetch_fails_fails_its_request(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    """A consumer asks its peers for an item given by metadata alone; the fetch fails.
    The request must end as unavailable (handed to vLLM, which fails it): never be
    let through to the encoder (no input: the model runner and the engine would
    fail), never deferred for ever. Nothing stays reserved or tracked; the next
    request with its input is encoded as usual."""
    producer_settings, consumer_settings, rows, before = _FAILED_FETCHES[cause]
    address = f"127.0.0.1:{free_port()}"
    producer = make_engine("ec_both", ec_peer_listen=address, **producer_settings)
    consumer = make_engine("ec_consumer", ec_peers=[address], **consumer_settings)
    item = Item(f"img-{cause}", rows)
    if before is not None:
        before(producer, consumer, item, monkeypatch)
    elif cause != "missing":
        producer.save(item)
    request = _metadata_only(make_request("r", [item]))
    assert not consumer.scheduler.ensure_cache_available(request, 0), "deferred while fetching"
    assert not _settle(consumer, request), "an item without input reached the encoder"
    assert _fallbacks(consumer) == {cause: 1}
    source = consumer.scheduler.remote
    assert not source._tasks and not source._fetching  # type: ignore[union-attr]
    assert consumer.scheduler.allocator.get(item.identifier) is None
    assert not consumer.scheduler.allocator.has_held_entries()
    # The same item with its input goes on as usual (encoded here, or fetched once
    # the injected fault is gone).
    monkeypatch.undo()
    again = make_request("r2", [item])
    assert _settle(consumer, again)
    meta = StepDriver(consumer.scheduler).step([again]).meta
    assert set(meta.loads) <= {item.identifier}


def test_an_item_without_input_that_a_peer_holds_is_fetched_and_loaded(
    make_engine: Callable[..., Engine],
) -> None:
    producer, consumer, _ = _pair(make_engine, **PATIENT)
    item = Item("img-meta", 6)
    producer.save(item)
    request = _metadata_only(make_request("r", [item]))
    assert not consumer.scheduler.ensure_cache_available(request, 0), "deferred while fetching"
    assert _settle(consumer, request)
    meta = StepDriver(consumer.scheduler).step([request]).meta
    assert set(meta.loads) == {"img-meta"} and meta.saves == {}
    cache = consumer.run_step(meta)
    assert torch.equal(cache["img-meta"], payload("img-meta", 6))
    assert _fallbacks(consumer) == {}
    _wait_unpinned(producer)


@pytest.mark.parametrize("held", [True, False], ids=["fetched", "missing"])
def test_an_item_without_input_waiting_on_another_requests_fetch(
    make_engine: Callable[..., Engine], held: bool
) -> None:
    """r1 (with input) fetches the item; r2 gives the same item by metadata alone and
    waits for r1's fetch. Landed, r2 is served; failed, r1 is encoded here and r2
    is failed (not left to the encoder, not deferred for ever)."""
    producer, consumer, _ = _pair(make_engine, **PATIENT)
    item = Item("img-shared", 4)
    if held:
        producer.save(item)
    first = make_request("r1", [item])
    second = _metadata_only(make_request("r2", [item]))
    assert not consumer.scheduler.ensure_cache_available(first, 0)
    assert not consumer.scheduler.ensure_cache_available(second, 0), "waits for r1's fetch"
    assert _settle(consumer, first)
    assert _settle(consumer, second) is held
    if held:
        meta = StepDriver(consumer.scheduler).step([first, second]).meta
        assert set(meta.loads) == {"img-shared"}
        cache = consumer.run_step(meta)
        assert torch.equal(cache["img-shared"], payload("img-shared", 4))
        _wait_unpinned(producer)
    else:
        assert _fallbacks(consumer) == {"missing": 1}, "asked for once"
        assert not consumer.scheduler.allocator.has_held_entries()


def test_three_engines_roll_to_a_new_secret_in_place_without_a_failed_fetch(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    """Three `ec_both` engines that list each other, each with its own secret file, go
    from secret A to B one engine at a time: [A] -> [A, B] -> [B, A] -> [B], each phase
    on every engine before the next, by rewriting that engine's file while it runs.
    After each rewrite the engine that changed serves an item to the other two and
    fetches one from them; every fetch succeeds and no message is refused. (Each
    save's request asks the peers first: "missing", one per save, is their answer,
    authentic under every phase.)"""
    a, b = "rolling-secret-A-0001", "rolling-secret-B-0002"
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    files = [write_secret_file(tmp_path / f"secret-file-{i}", a) for i in range(3)]
    engines = [
        make_engine(
            "ec_both",
            ec_peer_listen=address,
            ec_peers=[other for other in addresses if other != address],
            ec_peer_secret_file=files[i],
            **PATIENT,
        )
        for i, address in enumerate(addresses)
    ]
    fetched = saved = 0

    def save(into: int, key: str) -> None:
        """Encode and save `key` in engine `into`, after its peers said they lack it."""
        nonlocal saved
        request = make_request(f"s-{key}", [Item(key, 4)])
        engines[into].wait_available(request)
        meta = StepDriver(engines[into].scheduler).step([request]).meta
        assert set(meta.saves) == {key}
        engines[into].run_step(meta)
        saved += 1

    def fetch(into: int, key: str) -> None:
        nonlocal fetched
        request = make_request(f"r-{key}-{into}", [Item(key, 4)])
        engines[into].wait_available(request)
        meta = StepDriver(engines[into].scheduler).step([request]).meta
        assert set(meta.loads) == {key} and meta.saves == {}, f"{key} not fetched by {into}"
        cache = engines[into].run_step(meta)
        assert torch.equal(cache[key], payload(key, 4))
        fetched += 1

    for number, phase in enumerate([(a, b), (b, a), (b,)]):
        for i in range(3):
            write_secret_file(files[i], *phase)
            keyring = engines[i].scheduler.remote._keys  # type: ignore[union-attr]
            wanted = tuple(secret.encode() for secret in phase)
            _wait_for(lambda: keyring.accepted == wanted)  # noqa: B023 (called at once)
            served = f"img-{number}-{i}-served"
            save(i, served)
            for other in range(3):
                if other != i:
                    fetch(other, served)
            brought = f"img-{number}-{i}-brought"
            save((i + 1) % 3, brought)
            fetch(i, brought)
    assert fetched == 3 * 3 * 3
    for engine in engines:
        totals = engine.scheduler.stat_totals()
        # A save's request asks the peers first: "missing" is their (authentic) answer.
        assert set(_fallbacks(engine)) <= {"missing"}, "every fetch during the roll succeeded"
        assert totals["peer_requests_denied"] == 0, "no message was refused"
        assert engine.scheduler.remote._keys.reloads == 3  # type: ignore[union-attr]
    assert sum(_fallbacks(e).get("missing", 0) for e in engines) == saved == 2 * 3 * 3
    assert sum(e.scheduler.stat_totals()["remote_hits"] for e in engines) == fetched
    # (The second engine to fetch an item may be offered it by both its peers.)
    assert sum(e.scheduler.stat_totals()["peer_lookups_served"] for e in engines) >= fetched


def test_a_salted_entry_goes_only_to_requests_of_the_same_salt(
    make_engine: Callable[..., Engine],
) -> None:
    """Engines sharing the secret agree on salted keys (the salt's digest, never the
    salt). A producer's entry for salt A: a salt-B request is not served it through
    `ec_peers`, nor through a handle (with its lease) minted for a salt-A request;
    a salt-A request fetches it, through the handle, with A's bytes."""
    producer, consumer, _ = _pair(make_engine, producer=HANDLE_LEASES, **PATIENT)
    item = Item("img-salted", 6)
    producer.save(item, salt="salt-A")
    (key_a,) = producer.scheduler.tier_keys.keys_of(make_request("k", [item], cache_salt="salt-A"))
    assert consumer.scheduler.tier_keys.keys_of(make_request("k", [item], cache_salt="salt-A")) == [
        key_a
    ], "the same key on both engines"

    def serve(request: Any) -> dict[str, torch.Tensor]:
        consumer.wait_available(request)
        return consumer.run_step(StepDriver(consumer.scheduler).step([request]).meta)

    assert serve(make_request("b", [item], cache_salt="salt-B")) == {}, "encoded, not fetched"
    assert serve(make_request("plain", [item])) == {}, "nor for a request without a salt"
    assert consumer.scheduler.stat_totals()["remote_hits"] == 0
    assert consumer.scheduler.stat_totals()["remote_lookups"] == 2, "asked, found nothing"
    _, params = producer.scheduler.request_finished(
        make_request("done-a", [item], cache_salt="salt-A")
    )
    assert params is not None and params["ec_cpu_tier"]["items"] == {key_a: [6, WIDTH]}
    assert "lease" in params["ec_cpu_tier"] and "salt-A" not in repr(params)
    other = make_request("b-with-a-handle", [item], cache_salt="salt-B")
    other.ec_transfer_params = params
    assert serve(other) == {}, "a handle minted for salt A does not serve salt B"
    mine = make_request("a-with-its-handle", [item], cache_salt="salt-A")
    mine.ec_transfer_params = params
    cache = serve(mine)
    assert list(cache) == ["img-salted"] and torch.equal(cache["img-salted"], payload(key_a, 6))
    assert consumer.scheduler.stat_totals()["remote_hits"] == 1
    _wait_unpinned(producer)
