"""A scheduler whose cross-engine layer fails to start can be built again in the same
process, on the same port: the failed one released its sockets and threads.

Each case runs in a process of its own (a leak there cannot hang this one, and
warnings are not errors there, as in vLLM): a CPU worker creates the region, the
first scheduler fails (the listen port held by another socket, or NIXL's agent
refusing), the second one is built on the same settings and serves or fetches.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ectools.peer_secrets import secret_keys
from ectools.ports import free_port

SECRET = "a-test-secret-0123"

SCRIPT = """
import gc
import socket
import threading

import ec_transfer_nixl.agent as agent_module
from ec_core.worker_process.ranks import RankInfo
from ec_scheduler import ECCPUScheduler
from ec_worker_cpu.worker import CpuECCPUWorker
from ectools.configs import make_vllm_config

ROLE, EXTRA, FAILURE, MODEL = {role!r}, {extra!r}, {failure!r}, {model!r}
config = make_vllm_config(MODEL, role=ROLE, extra=EXTRA, widths={{"image": 128}})
worker = CpuECCPUWorker(config, rank_info=RankInfo(0, True))  # creates the region

holder = None
real_agent = agent_module.RegionAgent.__init__
if FAILURE == "port":
    host, port = EXTRA["ec_peer_listen"].rsplit(":", 1)
    holder = socket.socket()
    holder.bind((host, int(port)))
    holder.listen()
else:
    def refusing(self, name, *args):
        if name.startswith("ec-cpu-fetch"):
            raise RuntimeError("NIXL refused the agent")
        real_agent(self, name, *args)

    agent_module.RegionAgent.__init__ = refusing
try:
    ECCPUScheduler(config)
except RuntimeError as exc:
    print("first:", exc, flush=True)
else:
    raise AssertionError("the first scheduler was built")
if holder is not None:
    holder.close()
agent_module.RegionAgent.__init__ = real_agent
left = [t.name for t in threading.enumerate() if t.name.startswith("ec-cpu-peer")]
assert not left, left

scheduler = ECCPUScheduler(config)  # the same settings and port, in the same process
remote = scheduler.remote
assert remote.server is None or remote.server._thread.is_alive()
assert remote.fetcher is None or remote.fetcher.running
scheduler.shutdown()
worker.shutdown()
gc.collect()
print("rebuilt", flush=True)
"""


@pytest.mark.parametrize(
    ("role", "failure", "expected"),
    [
        # Encode-only on V1: the side channel is bound before the transport starts.
        ("ec_producer", "port", "cannot serve peers on"),
        ("ec_consumer", "agent", "cannot start the peer fetcher"),
        # The server started, then the fetcher failed: the server stops and unbinds.
        ("ec_both", "agent", "cannot start the peer fetcher"),
    ],
)
def test_a_failed_start_can_be_retried_in_the_same_process(
    tiny_model_dir: str, tmp_path: Path, role: str, failure: str, expected: str
) -> None:
    extra: dict[str, object] = {
        "ec_cpu_bytes": 64 * 128 * 4,
        "ec_cpu_dir": str(tmp_path),
        **secret_keys(tmp_path / "secret", SECRET),
    }
    if role != "ec_consumer":
        extra["ec_peer_listen"] = f"127.0.0.1:{free_port()}"
    if role != "ec_producer":
        extra["ec_peers"] = [f"127.0.0.1:{free_port()}"]
    code = SCRIPT.format(role=role, extra=extra, failure=failure, model=tiny_model_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process hung; it printed: {exc.stdout!r}")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert any(line.startswith("first:") and expected in line for line in lines), lines
    assert lines[-1] == "rebuilt"
