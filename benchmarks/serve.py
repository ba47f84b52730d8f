"""Serving benchmark: the OpenAI server without and with the tier, on repeated-image traffic.

    hatch run bench-serve [--concurrency 4] [--seed 0]

One run starts vLLM's OpenAI-compatible server (`python -m
vllm.entrypoints.openai.api_server`, see `ectools.serving`) twice, one after the
other (two at once would share the two cores): **without the tier** and **with
it** (`ec_both`, a 256 MiB region). Each gets the same seeded workloads, driven
by an asyncio load generator at a fixed concurrency, streaming chat completions
with one image part each (the tiny BLIP-2 takes one image per prompt):

* **chat**: multi-turn sessions whose images slide through a window, the shape
  of Dynamo's embedding-cache benchmark. Each turn brings a new image and asks
  again about the session's previous WINDOW-1 images (one request per image,
  since a prompt holds one), sessions interleaved;
* **popular**: a pool of images with Zipf popularity, and bursts in which one
  image is asked several times in a row.

The model is `REALISTIC`: a 12-layer vision tower at 224 px and encoder outputs
of 128 x 1024 fp32 = 512 KiB per image (a real VLM's hundreds of KB to MB). vLLM's
own encoder cache holds two images at `--max-num-batched-tokens 256`, so most
repeats miss it.

Reported side by side, per workload: time to first token p50/p99 (first
streamed content), requests per second, encoder runs, bytes the tier moved,
and whether the answers (greedy) are equal. Encoder runs come from the tier's
counters: the tier counts each item vLLM schedules that its own encoder cache
lacked (`lookups`, once per item however long its request waited), so runs =
lookups - region hits. For the server without the tier
that needs a connector too: it gets the tier as an `ec_consumer` with no peers,
which never saves and so never hits: it only counts. Warm-up requests (other
images) run before each measured workload.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ectools import metrics_plot, serving
from ectools.engine import make_images
from ectools.ports import free_port
from ectools.tiny_blip2 import REALISTIC, build_tiny_blip2

ROOT = Path(__file__).resolve().parents[1]

MAX_TOKENS = 4
WINDOW = 4
SESSIONS = 4
TURNS = 6
POOL = 24
POPULAR_REQUESTS = 48
BURST_P = 0.15
BURST_LEN = 3
ZIPF_A = 1.1
WARMUP = 3


@dataclass
class Workload:
    name: str
    describe: str
    order: list[int]
    """Image indices, in the order the requests are issued."""


def chat_workload(seed: int) -> Workload:
    """Sessions of TURNS turns; turn t sends image t and re-asks the window's older images."""
    rng = random.Random(seed)
    order: list[int] = []
    cursors = [0] * SESSIONS
    alive = list(range(SESSIONS))
    while alive:
        session = rng.choice(alive)
        turn = cursors[session]
        window = range(max(0, turn - WINDOW + 1), turn + 1)
        order += [session * TURNS + t for t in reversed(window)]  # newest first
        cursors[session] += 1
        if cursors[session] == TURNS:
            alive.remove(session)
    return Workload(
        "chat",
        f"{SESSIONS} sessions x {TURNS} turns, window {WINDOW}: {len(order)} requests, "
        f"{SESSIONS * TURNS} images",
        order,
    )


def popular_workload(seed: int) -> Workload:
    rng = random.Random(seed + 1)
    weights = [1 / (rank + 1) ** ZIPF_A for rank in range(POOL)]
    order: list[int] = []
    while len(order) < POPULAR_REQUESTS:
        image = rng.choices(range(POOL), weights)[0]
        order += [image] * (BURST_LEN if rng.random() < BURST_P else 1)
    order = order[:POPULAR_REQUESTS]
    return Workload(
        "popular",
        f"{POOL} images, Zipf a={ZIPF_A}, bursts of {BURST_LEN} (p={BURST_P}): "
        f"{len(order)} requests, {len(set(order))} images",
        [SESSIONS * TURNS + i for i in order],  # its own images, after the chat ones
    )


@dataclass
class Outcome:
    ttft_s: list[float] = field(default_factory=list)
    answers: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


async def _one(client: Any, model: str, url: str) -> tuple[float, str]:
    began = time.perf_counter()
    first: float | None = None
    text = []
    stream = await client.chat.completions.create(
        **serving.chat_body(model, url, MAX_TOKENS), stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            if first is None:
                first = time.perf_counter()
            text.append(chunk.choices[0].delta.content)
    return (first if first is not None else time.perf_counter()) - began, "".join(text)


async def _drive(
    port: int, model: str, urls: list[str], order: list[int], concurrency: int
) -> Outcome:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    gate = asyncio.Semaphore(concurrency)
    outcome = Outcome()

    async def request(position: int, image: int) -> None:
        async with gate:
            ttft, text = await _one(client, model, urls[image])
        outcome.ttft_s.append(ttft)
        outcome.answers[position] = text

    began = time.perf_counter()
    await asyncio.gather(*(request(i, image) for i, image in enumerate(order)))
    outcome.seconds = time.perf_counter() - began
    await client.close()
    return outcome


def _serve(
    label: str,
    *,
    model_dir: str,
    work: Path,
    ec_config: dict[str, Any],
    workloads: list[Workload],
    urls: list[str],
    concurrency: int,
    record: bool = False,
    plot: Path | None = None,
) -> tuple[float, dict[str, Outcome]]:
    """Start one server, run the workloads, stop it. With `record`, /metrics is sampled
    every second while they run (`plot`: drawn into that SVG)."""
    port = free_port()
    template = serving.write_template(work)
    log_path = work / f"{label}.log"
    command = serving.server_command(
        model_dir,
        port,
        template,
        ec_config=ec_config,
        max_num_batched_tokens=256,
        max_num_seqs=concurrency,
        max_model_len=256,
    )
    results: dict[str, Outcome] = {}
    with log_path.open("wb") as log:
        began = time.perf_counter()
        proc = serving.start_server(command, log)
        try:
            try:
                serving.wait_healthy({label: port}, [proc], timeout_s=900)
            except RuntimeError:
                sys.stderr.write(log_path.read_text()[-6000:])
                raise
            ready_s = time.perf_counter() - began
            print(f"  {label}: ready in {ready_s:.0f} s", flush=True)
            # A scrape is work the server does while the timed requests run: both sides
            # are sampled alike (`record`), only the with-tier side is drawn (`plot`).
            recorder = metrics_plot.Recorder(port) if record else None
            if recorder is not None:
                recorder.__enter__()
            for workload in workloads:
                warm = list(range(len(urls) - WARMUP, len(urls)))
                asyncio.run(_drive(port, model_dir, urls, warm, concurrency))
                before = serving.tier_metrics(port)
                outcome = asyncio.run(_drive(port, model_dir, urls, workload.order, concurrency))
                after = serving.tier_metrics(port)
                outcome.metrics = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                results[workload.name] = outcome
                print(f"  {label}: {workload.name} done in {outcome.seconds:.1f} s", flush=True)
            if recorder is not None:
                recorder.__exit__()
            if recorder is not None and plot is not None:
                metrics_plot.render_svg(
                    recorder.samples,
                    metrics_plot.serving_panels(),
                    plot,
                    f"bench-serve, {label}: the dashboard's panels over the run "
                    f"({', then '.join(w.name for w in workloads)}; 1 s samples of /metrics)",
                )
                print(f"  {label}: plot written to {plot}", flush=True)
        finally:
            serving.stop([proc])
    return ready_s, results


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=str(ROOT / "build" / "bench" / REALISTIC.tag()))
    parser.add_argument(
        "--plot",
        type=Path,
        help="write an SVG of the with-tier server's metrics over the run (both servers "
        "are sampled alike)",
    )
    args = parser.parse_args()
    serving.exit_on_termination()  # so that `finally` stops the servers
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    work = Path(tempfile.mkdtemp(prefix="ec-bench-serve-"))
    print(f"building the model (REALISTIC tiny BLIP-2) in {args.model_dir}", flush=True)
    model_dir = str(build_tiny_blip2(args.model_dir, REALISTIC))
    workloads = [chat_workload(args.seed), popular_workload(args.seed)]
    images = make_images(SESSIONS * TURNS + POOL + WARMUP, REALISTIC.image_size, seed=7000)
    urls = [serving.image_url(image) for image in images]
    entry_kib = REALISTIC.num_query_tokens * REALISTIC.text_hidden * 4 / 1024
    sides: dict[str, tuple[float, dict[str, Outcome]]] = {}
    for label, role in (("without tier", "ec_consumer"), ("with tier", "ec_both")):
        region = work / label.replace(" ", "-")
        region.mkdir()
        config = serving.tier_config(role, {"ec_cpu_bytes": "256MiB", "ec_cpu_dir": str(region)})
        sides[label] = _serve(
            label.replace(" ", "-"),
            model_dir=model_dir,
            work=work,
            ec_config=config,
            workloads=workloads,
            urls=urls,
            concurrency=args.concurrency,
            record=args.plot is not None,
            plot=args.plot if role == "ec_both" else None,
        )

    print()
    print(
        f"bench-serve: concurrency {args.concurrency}, seed {args.seed}, {MAX_TOKENS} output "
        f"tokens; encoder output {REALISTIC.num_query_tokens} x {REALISTIC.text_hidden} fp32 = "
        f"{entry_kib:.0f} KiB per image; server ready in {sides['without tier'][0]:.0f} s / "
        f"{sides['with tier'][0]:.0f} s"
    )
    header = f"{'workload':<9} {'':<24} {'without tier':>13} {'with tier':>11} {'with/without':>13}"
    print(header)
    for workload in workloads:
        base, tier = sides["without tier"][1][workload.name], sides["with tier"][1][workload.name]

        def runs(outcome: Outcome) -> float:
            m = outcome.metrics
            return m.get("vllm:ec_cpu_lookups_total", 0.0) - m.get("vllm:ec_cpu_hits_total", 0.0)

        def moved(outcome: Outcome) -> float:
            m = outcome.metrics
            return (
                m.get("vllm:ec_cpu_bytes_saved_total", 0.0)
                + m.get("vllm:ec_cpu_bytes_loaded_total", 0.0)
            ) / 2**20

        rows = [
            (
                "TTFT p50 (ms)",
                statistics.median(base.ttft_s) * 1e3,
                statistics.median(tier.ttft_s) * 1e3,
            ),
            (
                "TTFT p99 (ms)",
                _percentile(base.ttft_s, 0.99) * 1e3,
                _percentile(tier.ttft_s, 0.99) * 1e3,
            ),
            ("requests/s", len(workload.order) / base.seconds, len(workload.order) / tier.seconds),
            ("encoder runs", runs(base), runs(tier)),
            ("MiB moved by the tier", moved(base), moved(tier)),
        ]
        for index, (name, a, b) in enumerate(rows):
            label = workload.name if index == 0 else ""
            ratio = f"{b / a:.2f}x" if a else "-"
            print(f"{label:<9} {name:<24} {a:>13.1f} {b:>11.1f} {ratio:>13}")
        same = sum(base.answers[i] == tier.answers[i] for i in base.answers)
        print(f"{'':<9} {'answers equal':<24} {f'{same}/{len(base.answers)}':>25}")
        print(f"{'':<9} ({workload.describe})")


if __name__ == "__main__":
    main()
