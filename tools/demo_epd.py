"""Encoder/prefill disaggregation: two OpenAI-compatible vLLM CPU servers and a proxy.

    hatch run demo-epd [--images N]

Starts, each as its own `python -m vllm.entrypoints.openai.api_server`:

* an **encoder instance** (`ec_producer`, `ec_peer_listen`): it encodes images
  and keeps their encoder outputs in its CPU region;
* a **prefill instance** (`ec_consumer`, no `ec_peers`): it fetches encoder
  outputs from whichever producer a request's `ec_transfer_params` name.

Both share a secret through `EC_CPU_TIER_PEER_SECRET`. A small proxy (in this
process) takes each chat completion, sends it to the encoder instance with
`max_tokens=1` and `n=1`, and forwards the request to the prefill instance with the
`ec_transfer_params` the encoder's response carried. The demo sends the same
images straight to the prefill instance too (it encodes them itself) and prints,
side by side: the time per request, encoder runs on the prefill side (read from
its `/metrics`), bytes fetched, and whether the answers equal those the prefill
instance gave for the same images when it encoded them itself (sent first,
then other images so that vLLM's own encoder cache has forgotten them; an
`ec_consumer` never saves, so its region cannot answer them either).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from demo import Ticker
from ectools import serving
from ectools.engine import make_images
from ectools.ports import free_port
from ectools.serving import ask, tier_metrics
from ectools.tiny_blip2 import HEAVY_VISION, build_tiny_blip2

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
FLUSH = 6
"""Other images sent between the two sides: more than vLLM's own encoder cache holds."""


class Proxy:
    """The EPD proxy: encoder instance first (max_tokens=1, n=1), then the prefill
    instance with the `ec_transfer_params` the encoder returned."""

    def __init__(self, encoder: str, prefill: str) -> None:
        import httpx

        self.encoder, self.prefill = encoder, prefill
        self.client = httpx.Client(timeout=300)
        self.stage_seconds: list[tuple[float, float]] = []
        self.handles_forwarded = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    status, answer = proxy.forward(self.path, body)
                except Exception as exc:  # an upstream unreachable or not answering JSON
                    status, answer = 502, {"error": {"message": f"EPD proxy: {exc!r}"}}
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def forward(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        began = time.perf_counter()
        # One sample (n=1): vLLM runs each of n samples as a request of its own, each
        # with a handle lease on the same entries, and returns one handle; the others'
        # leases would keep those entries pinned, unclaimed, until they expire.
        encode = {**body, "max_tokens": 1, "n": 1}
        first = self.client.post(f"{self.encoder}{path}", json=encode)
        encoded = time.perf_counter()
        if first.status_code != 200:
            return first.status_code, first.json()
        handles = first.json().get("ec_transfer_params")
        second_body = dict(body)
        if handles:
            second_body["ec_transfer_params"] = handles
            self.handles_forwarded += 1
        second = self.client.post(f"{self.prefill}{path}", json=second_body)
        self.stage_seconds.append((encoded - began, time.perf_counter() - encoded))
        return second.status_code, second.json()

    def close(self) -> None:
        self.http.shutdown()
        self.client.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=8, help="distinct images (default 8)")
    parser.add_argument("--model-dir", default=str(ROOT / "build" / "demo" / HEAVY_VISION.tag()))
    args = parser.parse_args()
    if args.images < 1:  # refused before the servers start (minutes)
        parser.error("--images must be at least 1")
    serving.exit_on_termination()  # so that `finally` stops the servers
    from openai import OpenAI

    work = Path(tempfile.mkdtemp(prefix="ec-demo-epd-"))
    template = serving.write_template(work)
    ports = {"encoder": free_port(), "prefill": free_port()}
    peer = f"127.0.0.1:{free_port()}"
    os.environ["EC_CPU_TIER_PEER_SECRET"] = secrets.token_hex(16)
    procs: list[subprocess.Popen[bytes]] = []
    log = open(work / "servers.log", "wb")  # noqa: SIM115 (closed in finally)
    with Ticker() as ticker:
        try:
            ticker.say("building the tiny BLIP-2 (offline, random weights)")
            model_dir = str(build_tiny_blip2(args.model_dir, HEAVY_VISION))
            (work / "encoder").mkdir()
            (work / "prefill").mkdir()
            region = {"ec_cpu_bytes": "64MiB"}
            ticker.say(f"starting the encoder instance (ec_producer, ec_peer_listen {peer})")
            procs.append(
                serving.start_server(
                    serving.server_command(
                        model_dir,
                        ports["encoder"],
                        template,
                        ec_config=serving.tier_config(
                            "ec_producer",
                            {**region, "ec_cpu_dir": str(work / "encoder"), "ec_peer_listen": peer},
                        ),
                    ),
                    log,
                )
            )
            ticker.say("starting the prefill instance (ec_consumer, no ec_peers)")
            procs.append(
                serving.start_server(
                    serving.server_command(
                        model_dir,
                        ports["prefill"],
                        template,
                        ec_config=serving.tier_config(
                            "ec_consumer",
                            {**region, "ec_cpu_dir": str(work / "prefill")},
                        ),
                    ),
                    log,
                )
            )
            ticker.say("waiting for both servers")
            try:
                serving.wait_healthy(
                    ports,
                    procs,
                    on_ready=lambda label, port: ticker.say(
                        f"{label} instance ready on port {port}"
                    ),
                )
            except RuntimeError:
                log.flush()
                sys.stderr.write((work / "servers.log").read_text()[-6000:])
                raise
            encoder_url = f"http://127.0.0.1:{ports['encoder']}"
            prefill_url = f"http://127.0.0.1:{ports['prefill']}"
            proxy = Proxy(encoder_url, prefill_url)
            images = make_images(args.images + FLUSH, HEAVY_VISION.image_size, seed=4000)
            proxied, flush = images[: args.images], images[args.images :]
            # No retries: a failure shows, rather than re-running both stages silently
            # inside a timed request.
            via_proxy = OpenAI(
                base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="-", max_retries=0
            )
            direct = OpenAI(base_url=f"{prefill_url}/v1", api_key="-", max_retries=0)
            ticker.say(f"{args.images} images straight to the prefill instance (it encodes)")
            alone_before = tier_metrics(ports["prefill"])
            alone = [ask(direct, model_dir, image, MAX_TOKENS) for image in proxied]
            alone_after = tier_metrics(ports["prefill"])
            for image in flush:  # so vLLM's own encoder cache no longer holds them
                ask(direct, model_dir, image, MAX_TOKENS)
            before = tier_metrics(ports["prefill"])
            ticker.say(f"the same {args.images} images through the proxy (encoder, then prefill)")
            epd = [ask(via_proxy, model_dir, image, MAX_TOKENS) for image in proxied]
            after = tier_metrics(ports["prefill"])
            proxy.close()
        finally:
            serving.stop(procs)
            log.close()
    _print_table(
        args.images,
        epd=epd,
        alone=alone,
        proxy=proxy,
        before=before,
        after=after,
        alone_before=alone_before,
        alone_after=alone_after,
    )


def _print_table(
    count: int,
    *,
    epd: list[tuple[str, float]],
    alone: list[tuple[str, float]],
    proxy: Proxy,
    before: dict[str, float],
    after: dict[str, float],
    alone_before: dict[str, float],
    alone_after: dict[str, float],
) -> None:
    """The table. `before`/`after`: the prefill instance's tier metrics around the
    proxied requests; `alone_before`/`alone_after`: around the requests sent to it alone."""

    def delta(name: str, start: dict[str, float] = before, end: dict[str, float] = after) -> float:
        key = f"vllm:ec_cpu_{name}_total"
        return end.get(key, 0.0) - start.get(key, 0.0)

    # Encoder runs as measured on both sides, as bench-serve counts them: the tier counts
    # each scheduled item vLLM's own cache lacked, so runs = lookups - region hits.
    runs = delta("lookups") - delta("hits")
    alone_runs = delta("lookups", alone_before, alone_after) - delta(
        "hits", alone_before, alone_after
    )
    alone_hits = delta("hits", alone_before, alone_after)
    fetched = delta("remote_hits")
    same = sum(a == b for (a, _), (b, _) in zip(epd, alone, strict=True))
    enc_s = statistics.median(s for s, _ in proxy.stage_seconds)
    pre_s = statistics.median(s for _, s in proxy.stage_seconds)
    rows = [
        ("requests (the same images on both sides)", str(count), str(count)),
        ("ec_transfer_params forwarded", str(proxy.handles_forwarded), "-"),
        ("encoder runs on the prefill instance", f"{runs:.0f}", f"{alone_runs:.0f}"),
        (
            "encoder runs avoided on the prefill instance",
            f"{delta('hits'):.0f}",
            f"{alone_hits:.0f}",
        ),
        ("fetches that fell back to a local encode", f"{delta('remote_fallbacks'):.0f}", "-"),
        ("bytes fetched over NIXL", f"{delta('bytes_fetched'):.0f}", "-"),
        (
            "time per request, median",
            f"{statistics.median(s for _, s in epd) * 1e3:.0f} ms",
            f"{statistics.median(s for _, s in alone) * 1e3:.0f} ms",
        ),
        ("  of which the encoder instance (max_tokens=1)", f"{enc_s * 1e3:.0f} ms", "-"),
        ("  of which the prefill instance", f"{pre_s * 1e3:.0f} ms", "-"),
        ("answers equal to the prefill instance's own", f"{same}/{count}", "-"),
    ]
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'':<{width}}  {'proxy: encoder→prefill':>24}  {'prefill alone':>14}")
    for name, a, b in rows:
        print(f"{name:<{width}}  {a:>24}  {b:>14}")
    if same != count or fetched != count:
        raise SystemExit("the prefill instance did not serve every proxied image from the encoder")


if __name__ == "__main__":
    main()
