"""A scheduler whose construction fails releases what it opened before the failure.

On an encode-only engine that serves peers (V1 runner), the scheduler binds the
report side channel (`ec_core.report_channel`) before it builds the transport,
which may then fail (its port in use, NIXL missing or refusing). vLLM raises
that error; nothing of the failed scheduler may outlive it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import ec_scheduler.connections as connections_module
from ec_core.region.reservation import RegionReservation
from ec_scheduler import ECCPUScheduler
from ectools.configs import make_vllm_config
from ectools.peer_secrets import secret_keys
from ectools.ports import free_port

SECRET = "a-test-secret-0123"


def _free_address() -> str:
    return f"127.0.0.1:{free_port()}"


SCRIPT = """
import gc
import os
import threading

import ec_scheduler.connections as connections_module
from ec_core.region.reservation import RegionReservation
from ec_scheduler import ECCPUScheduler
from ectools.configs import make_vllm_config


def failing(*args):
    raise RuntimeError("the transport failed")


def fails_with_the_transports_error(config):
    try:
        ECCPUScheduler(config)
    except RuntimeError as exc:
        if "the transport failed" in str(exc):
            return
        print("unexpected:", exc, flush=True)
    except Exception as exc:
        print("unexpected:", type(exc).__name__, exc, flush=True)
    else:
        print("unexpected: the scheduler was built", flush=True)
    os._exit(1)


connections_module.load_remote_source = failing
config = make_vllm_config({model!r}, role="ec_producer", extra={extra!r}, widths={{"image": 128}})
fails_with_the_transports_error(config)
# Built again in the same process: the transport's error again, not "Address already
# in use" from the side channel the first one left bound.
fails_with_the_transports_error(config)
# The failed schedulers are in reference cycles: the cyclic collector frees them. A ZMQ
# context of theirs collected before its open socket would wait for it for ever.
collector = threading.Thread(target=gc.collect, daemon=True)
collector.start()
collector.join(60)
if collector.is_alive():
    print("unexpected: the garbage collection hung", flush=True)
    os._exit(1)
print("released", flush=True)
"""


def test_a_failed_transport_releases_the_side_channel(tiny_model_dir: str, tmp_path: Path) -> None:
    """In a process of its own: a leak there cannot hang this one, and warnings are not
    errors there (as in vLLM; a ResourceWarning raised would keep the leak from the
    collector)."""
    extra = {
        "ec_cpu_bytes": "1MiB",
        "ec_cpu_dir": str(tmp_path),
        "ec_peer_listen": _free_address(),
        **secret_keys(tmp_path / "secret", SECRET),
    }
    code = SCRIPT.format(model=tiny_model_dir, extra=extra)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process hung; it printed: {exc.stdout!r}")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "released"


def test_a_failed_transport_closes_the_reservation_it_follows(
    tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shell's scheduler follows the region's reservation, whose file it holds open
    while the workers still reserve (seconds for a large region)."""
    closed: list[bool] = []

    class Reservation(RegionReservation):
        def close(self) -> None:
            closed.append(True)
            super().close()

    def failing(*args: Any) -> Any:
        raise RuntimeError("the transport failed")

    monkeypatch.setattr(connections_module, "RegionReservation", Reservation)
    monkeypatch.setattr(connections_module, "load_remote_source", failing)
    extra = {
        "ec_cpu_bytes": "1MiB",
        "ec_cpu_dir": str(tmp_path),
        "ec_peer_listen": _free_address(),
        **secret_keys(tmp_path / "secret", SECRET),
    }
    config = make_vllm_config(tiny_model_dir, role="ec_both", extra=extra, widths={"image": 128})
    with pytest.raises(RuntimeError, match="the transport failed"):
        ECCPUScheduler(config, follow_reservation=True)
    assert closed
