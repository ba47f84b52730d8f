"""The tier behind vLLM's OpenAI-compatible server, for real: HTTP in, HTTP out, /metrics.

The server runs as a user on CPU runs it (`python -m vllm.entrypoints.openai.api_server`,
see `ectools.serving` for why not `vllm serve`), once without the tier and once with
it, one after the other (two at once would share the two cores). Chat completions
with an image part go through the `openai` client: K distinct images, then the same
K again. vLLM's own encoder cache holds about one image at this batch size, so the
second pass misses it and, with the tier, is served from the CPU region.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ectools import serving
from ectools.engine import make_images
from ectools.ports import free_port
from ectools.serving import ask
from ectools.tiny_blip2 import TinyBlip2

pytestmark = pytest.mark.engine

K = 6
MAX_TOKENS = 6


SALT = "tenant-7c1f0e"


def _serve_twice(
    model_dir: str, work: Path, ec_config: dict[str, Any] | None, *, salted: bool = False
) -> dict[str, Any]:
    """Start one server, send K images twice, read /metrics after each pass; stop it.
    `salted`: then the K images twice more with vLLM's `cache_salt` (another tenant)."""
    from openai import OpenAI

    port = free_port()
    template = serving.write_template(work)
    log_path = work / f"server-{port}.log"
    with log_path.open("wb") as log:
        proc = serving.start_server(
            serving.server_command(model_dir, port, template, ec_config=ec_config), log
        )
        try:
            try:
                serving.wait_healthy({"server": port}, [proc], timeout_s=600)
            except RuntimeError:
                raise AssertionError(log_path.read_text()[-4000:]) from None
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
            images = make_images(K, TinyBlip2().image_size, seed=5000)
            first = [ask(client, model_dir, image, MAX_TOKENS)[0] for image in images]
            after_first = serving.tier_metrics(port)
            second = [ask(client, model_dir, image, MAX_TOKENS)[0] for image in images]
            after_second = serving.tier_metrics(port)
            families = serving.tier_families(port)
            salted_passes: list[list[str]] = []
            if salted:
                for _ in range(2):
                    salted_passes.append(
                        [ask(client, model_dir, im, MAX_TOKENS, SALT)[0] for im in images]
                    )
            after_salted = serving.tier_metrics(port)
            metrics_text = serving.metrics_text(port)
        finally:
            serving.stop([proc])
    return {
        "salted": salted_passes,
        "after_salted": after_salted,
        "metrics_text": metrics_text,
        "log": log_path.read_text(errors="replace"),
        "first": first,
        "second": second,
        "after_first": after_first,
        "after_second": after_second,
        "families": families,
    }


def test_the_openai_server_serves_repeated_images_from_the_tier(
    model_dir: str, tmp_path: Path
) -> None:
    plain_dir = tmp_path / "plain"
    tier_dir = tmp_path / "tier"
    region_dir = tmp_path / "region"
    for directory in (plain_dir, tier_dir, region_dir):
        directory.mkdir()
    plain = _serve_twice(model_dir, plain_dir, None)
    assert len(set(plain["first"])) >= K // 2, plain["first"]  # images give distinct answers
    assert plain["second"] == plain["first"]
    assert plain["families"] == set()  # no tier, no families

    config = serving.tier_config(
        "ec_both", {"ec_cpu_bytes": "64MiB", "ec_cpu_dir": str(region_dir)}
    )
    tier = _serve_twice(model_dir, tier_dir, config, salted=True)
    assert tier["first"] == plain["first"]
    assert tier["second"] == plain["first"]
    # Another tenant (a cache_salt): not served the unsalted entries, then its own.
    assert tier["salted"] == [plain["first"], plain["first"]]

    def delta(name: str) -> float:
        key = f"vllm:ec_cpu_{name}_total"
        return tier["after_second"].get(key, 0.0) - tier["after_first"].get(key, 0.0)

    assert tier["after_first"].get("vllm:ec_cpu_saves_total") == K
    assert delta("hits") == K  # every repeat was served from the region
    assert delta("loads") == K
    assert delta("saves") == 0
    assert delta("bytes_loaded") > 0
    assert tier["after_second"]["vllm:ec_cpu_region_entries"] == K
    for family in (
        "vllm:ec_cpu_lookups",
        "vllm:ec_cpu_hits",
        "vllm:ec_cpu_bytes_saved",
        "vllm:ec_cpu_bytes_loaded",
        "vllm:ec_cpu_load_copy_seconds",
        "vllm:ec_cpu_evictions",
        "vllm:ec_cpu_reclaimed",
        "vllm:ec_cpu_region_used_blocks",
        "vllm:ec_cpu_region_blocks",
        "vllm:ec_cpu_policy_lru_mode",
    ):
        assert family in tier["families"], sorted(tier["families"])

    def salted_delta(name: str) -> float:
        key = f"vllm:ec_cpu_{name}_total"
        return tier["after_salted"].get(key, 0.0) - tier["after_second"].get(key, 0.0)

    assert salted_delta("saves") == K, "the salted tenant's images were encoded and saved"
    assert salted_delta("hits") == K, "and its repeats served from its own entries"
    # The salt is in no log line (engine and access log) and no metric.
    assert SALT not in tier["log"] and SALT not in tier["metrics_text"]
    assert "POST /v1/chat/completions" in tier["log"], "the access log is in the log"
    assert list(region_dir.iterdir()) == []  # the server removed its region on shutdown
