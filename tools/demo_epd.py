"""Encoder/prefill disaggregation: two OpenAI-compatible vLLM CPU servers and a proxy.

    hatch run demo-epd [--images N]

Starts, each as its own `python -m vllm.entrypoints.openai.api_server`:

* an **encoder instance** (`ec_producer`, `ec_peer_listen`): it encodes images
  and keeps their encoder outputs in its CPU region;
* a **prefill instance** (`ec_consumer`, no `ec_peers`): it fetches encoder
  outputs from whichever producer a request's `ec_transfer_params` name.

Both share a secret through `EC_CPU_TIER_PEER_SECRET`. A small proxy (in this
process) takes each chat completion, sends it to the encoder instance with
`max_tokens=1`, and forwards the request to the prefill instance with the
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
import base64
import io
import json
import os
import secrets
import socket
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
from ectools.engine import engine_env, make_images
from ectools.tiny_blip2 import HEAVY_VISION, build_tiny_blip2

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Question: what is in the picture? Answer:"
MAX_TOKENS = 8
FLUSH = 6
"""Other images sent between the two sides: more than vLLM's own encoder cache holds."""
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}"
)
"""BLIP-2 has no chat template; this one keeps the text (vLLM places the image)."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _server(
    model_dir: str, port: int, template: Path, *, role: str, extra: dict[str, Any], log: Any
) -> subprocess.Popen[bytes]:
    config = {
        "ec_connector": "ECCPUTierConnector",
        "ec_role": role,
        "ec_connector_extra_config": extra,
    }
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        model_dir,
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "4",
        "--limit-mm-per-prompt",
        json.dumps({"image": 1}),
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--seed",
        "0",
        "--chat-template",
        str(template),
        "--ec-transfer-config",
        json.dumps(config),
    ]
    env = engine_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; the default wants more
    return subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _wait_healthy(
    ports: dict[str, int], procs: list[subprocess.Popen[bytes]], ticker: Ticker
) -> None:
    import httpx

    waiting = dict(ports)
    deadline = time.monotonic() + 900
    while waiting:
        for label, port in list(waiting.items()):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    ticker.say(f"{label} instance ready on port {port}")
                    del waiting[label]
            except httpx.HTTPError:
                pass
        if any(proc.poll() is not None for proc in procs):
            raise SystemExit("a server exited before it was ready (its log is printed above)")
        if time.monotonic() > deadline:
            raise SystemExit(f"servers not ready after 900 s: {sorted(waiting)}")
        time.sleep(1)


class Proxy:
    """The EPD proxy: encoder instance first (max_tokens=1), then the prefill
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
                status, answer = proxy.forward(self.path, body)
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
        first = self.client.post(f"{self.encoder}{path}", json={**body, "max_tokens": 1})
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


def _image_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _ask(client: Any, model: str, image: Any) -> tuple[str, float]:
    began = time.perf_counter()
    response = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _image_url(image)}},
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return response.choices[0].message.content or "", time.perf_counter() - began


def _metrics(port: int) -> dict[str, float]:
    """The tier's counters on a server's /metrics, summed over labels."""
    import httpx

    found: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:ec_cpu_") and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    import signal

    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=8, help="distinct images (default 8)")
    parser.add_argument("--model-dir", default=str(ROOT / "build" / "demo" / HEAVY_VISION.tag()))
    args = parser.parse_args()
    from openai import OpenAI

    work = Path(tempfile.mkdtemp(prefix="ec-demo-epd-"))
    template = work / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    ports = {"encoder": _free_port(), "prefill": _free_port()}
    peer = f"127.0.0.1:{_free_port()}"
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
                _server(
                    model_dir,
                    ports["encoder"],
                    template,
                    role="ec_producer",
                    extra={**region, "ec_cpu_dir": str(work / "encoder"), "ec_peer_listen": peer},
                    log=log,
                )
            )
            ticker.say("starting the prefill instance (ec_consumer, no ec_peers)")
            procs.append(
                _server(
                    model_dir,
                    ports["prefill"],
                    template,
                    role="ec_consumer",
                    extra={**region, "ec_cpu_dir": str(work / "prefill")},
                    log=log,
                )
            )
            ticker.say("waiting for both servers")
            try:
                _wait_healthy(ports, procs, ticker)
            except SystemExit:
                log.flush()
                sys.stderr.write((work / "servers.log").read_text()[-6000:])
                raise
            encoder_url = f"http://127.0.0.1:{ports['encoder']}"
            prefill_url = f"http://127.0.0.1:{ports['prefill']}"
            proxy = Proxy(encoder_url, prefill_url)
            images = make_images(args.images + FLUSH, HEAVY_VISION.image_size, seed=4000)
            proxied, flush = images[: args.images], images[args.images :]
            via_proxy = OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="-")
            direct = OpenAI(base_url=f"{prefill_url}/v1", api_key="-")
            ticker.say(f"{args.images} images straight to the prefill instance (it encodes)")
            alone = [_ask(direct, model_dir, image) for image in proxied]
            for image in flush:  # so vLLM's own encoder cache no longer holds them
                _ask(direct, model_dir, image)
            before = _metrics(ports["prefill"])
            ticker.say(f"the same {args.images} images through the proxy (encoder, then prefill)")
            epd = [_ask(via_proxy, model_dir, image) for image in proxied]
            after = _metrics(ports["prefill"])
            proxy.close()
        finally:
            _stop(procs)
            log.close()
    _print_table(args.images, epd=epd, alone=alone, proxy=proxy, before=before, after=after)


def _print_table(
    count: int,
    *,
    epd: list[tuple[str, float]],
    alone: list[tuple[str, float]],
    proxy: Proxy,
    before: dict[str, float],
    after: dict[str, float],
) -> None:
    def delta(name: str) -> float:
        key = f"vllm:ec_cpu_{name}_total"
        return after.get(key, 0.0) - before.get(key, 0.0)

    fetched = delta("remote_hits")
    same = sum(a == b for (a, _), (b, _) in zip(epd, alone, strict=True))
    enc_s = statistics.median(s for s, _ in proxy.stage_seconds)
    pre_s = statistics.median(s for _, s in proxy.stage_seconds)
    rows = [
        ("requests (the same images on both sides)", str(count), str(count)),
        ("ec_transfer_params forwarded", str(proxy.handles_forwarded), "-"),
        ("encoder runs on the prefill instance", f"{count - fetched:.0f}", str(count)),
        ("encoder runs avoided on the prefill instance", f"{fetched:.0f}", "0"),
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
