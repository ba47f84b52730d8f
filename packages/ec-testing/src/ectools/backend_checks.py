"""Checks every backend package must pass, shared by their test modules."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

from ectools.checkout import ROOT


def check_backend_announcement(
    monkeypatch: pytest.MonkeyPatch, package: str, device_type: str
) -> None:
    """The backend is found through its entry point as the one for `device_type`, and
    vLLM's factory resolves ECCPUTierConnector and the backend's alias to the one shell:
    by module path (ec_scheduler or the backend package), then, after the plugin ran
    (twice: vLLM loads plugins repeatedly), by name alone."""
    from ec_scheduler.shell.backends import CONNECTOR_NAME, installed_backends
    from ec_scheduler.shell.connector import ECCPUTierConnector
    from ec_scheduler.shell.plugin import register

    backend = importlib.import_module(package).BACKEND
    assert installed_backends()[device_type] == backend
    assert backend.alias and backend.worker.startswith(f"{package}.worker:")
    registry = {
        name: loader
        for name, loader in ECConnectorFactory._registry.items()
        if name not in (CONNECTOR_NAME, backend.alias)
    }
    monkeypatch.setattr(ECConnectorFactory, "_registry", registry)
    for name, path in (
        (CONNECTOR_NAME, "ec_scheduler"),
        (CONNECTOR_NAME, package),
        (backend.alias, package),
    ):
        config = ECTransferConfig(
            ec_connector=name, ec_role="ec_both", ec_connector_module_path=path
        )
        assert ECConnectorFactory.get_connector_class(config) is ECCPUTierConnector, (name, path)
    register()
    register()
    for name in (CONNECTOR_NAME, backend.alias):
        config = ECTransferConfig(ec_connector=name, ec_role="ec_both")
        assert ECConnectorFactory.get_connector_class(config) is ECCPUTierConnector, name


def modules_after_import(imports: Sequence[str], watch: Sequence[str]) -> list[str]:
    """Which of `watch` a fresh interpreter has loaded after importing `imports`."""
    code = textwrap.dedent(
        f"""
        import sys
        import {", ".join(imports)}
        print(",".join(m for m in {list(watch)!r} if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return [m for m in out.stdout.strip().split(",") if m]


def run_fake_device_checks(
    module: str, *, python: str = sys.executable, out: Path | None = None
) -> str:
    """Run a backend's hardware checks (`python -m module`) on the fake runtime; its stdout.

    The checks' whole flow (round trips of every dtype and block order
    through both paths, throughput, overlap, the injected failure,
    registration, the table and its exit code) is thus exercised on a CPU
    box; on a device host the same command runs for real. `python` may be
    another interpreter (a torch-only venv, where nothing of this repository
    is installed): it then runs as on a bare device host, with only this
    package's source on `PYTHONPATH`. `out` is passed as `--out`.
    """
    # No time budget: on a slow or loaded machine the registration rows checked
    # below would be skipped (the budget is for a device host's whole run).
    command = [python, "-m", module, "--fake", "--quick", "--budget", "inf"]
    if out is not None:
        command += ["--out", str(out)]
    env = dict(os.environ)
    if python != sys.executable:
        env["PYTHONPATH"] = str(ROOT / "packages" / "ec-testing" / "src")
    done = subprocess.run(
        command,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "OK: 0 failed check(s)" in done.stdout
    rows = table_rows(done.stdout)
    # Content, not layout: the column widths follow the measured figures.
    for dtype in ("bfloat16", "float16", "float32"):
        for order in ("contiguous", "scrambled"):
            for path in ("batched", "per-run"):
                result, detail = rows[f"round trips {dtype} {order} [{path}]"]
                assert result == "exact" and detail.startswith("4 entries, 16-1024 rows"), rows
    for op in ("save", "load"):
        for mb in (1, 8):
            for path in ("batched", "per-run"):
                ours, detail = rows[f"{op} {mb} MB [{path}]"]
                assert ours.endswith(" GB/s"), rows
                assert re.fullmatch(
                    r"\d+\.\d\dx copy_ \(.+ GB/s\), \d+\.\d\dx memmove \(.+ GB/s\)", detail
                ), detail
    overlap = [cells for name, cells in rows.items() if name.startswith("overlap: save 16 MB")]
    assert len(overlap) == 1 and overlap[0][0].endswith("% hidden"), rows
    result, detail = rows["injected failure in the batched copy"]
    assert result == "recovered: bytes exact", rows
    assert detail == "batch_copy raised 2x; fallbacks reported: save 2, load 2", detail
    for size in ("64 MiB", "256 MiB"):
        result, detail = rows[f"register {size} region"]
        assert result.endswith("GB/s)") and detail.startswith("fake register_host;"), rows
    return done.stdout


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of a printed table: first cell -> the other cells (cells are
    separated by two or more spaces)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) > 1:
            rows[cells[0]] = cells[1:]
    return rows
