"""A virtual environment that has torch and nothing else: the GPU check host, emulated.

The GPU machine the device checks run on has PyTorch and no vLLM, no numpy, no
transformers and no network. `make_torch_only_venv` builds a venv (without pip)
whose only importable third-party packages are the installed torch and the
distributions torch itself requires, linked in from this interpreter's
site-packages; this repository's packages are *not* installed into it, so a
script run there must find them on its own, as it must on the GPU host.

Used by the tests of the vLLM-less device-check path; runs on any host.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def torch_closure() -> list[importlib.metadata.Distribution]:
    """The installed torch distribution and every distribution it requires (no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = ["torch"]
    while todo:
        name = todo.pop()
        if _normal(name) in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional requirement this host does not have
        found[_normal(name)] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(found.values())


def _top_level_entries(dist: importlib.metadata.Distribution) -> set[str]:
    """The names a distribution puts at the top of site-packages (packages, modules, dist-info)."""
    entries: set[str] = set()
    for file in dist.files or []:
        parts = Path(file).parts
        if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith(".pth"):
            continue
        entries.add(parts[0])
    return entries


def make_torch_only_venv(directory: Path) -> Path:
    """Create the venv in `directory`; return its python.

    Guarantees: `import torch` works there; `vllm`, `numpy` (unless torch
    requires it), `transformers` and this repository's packages do not import.
    """
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(directory)],
        check=True,
        capture_output=True,
    )
    python = directory / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    target = Path(site)
    for dist in torch_closure():
        source_root = Path(str(dist.locate_file("")))
        for entry in _top_level_entries(dist):
            source = source_root / entry
            link = target / entry
            if source.exists() and not link.exists():
                os.symlink(source, link)
    return python
