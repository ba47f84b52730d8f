"""Checks every backend package must pass, shared by their test modules."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory


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


def run_fake_device_checks(script: Path) -> str:
    """Run a backend's hardware-check script on the fake runtime; its stdout.

    The script's whole flow (round trips, bandwidth table, exit code) is thus
    exercised on a CPU box; on a device host the same script runs for real.
    """
    out = subprocess.run(
        [sys.executable, str(script), "--fake", "--quick"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK: 0 mismatch(es)" in out.stdout
    rows = table_rows(out.stdout)
    # Content, not layout: the column widths follow the measured figures.
    for size in (16, 100, 577, 1024):
        assert rows[f"round trip rows{size}"] == ["bytes", "exact"], rows
    for op in ("save", "load"):
        for mb in (1, 8):
            worker, plain, ratio = rows[f"{op} {mb} MB"]
            assert worker.endswith(" GB/s") and plain.endswith(" GB/s"), rows
            assert float(ratio) > 0
    return out.stdout


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of a printed table: first cell -> the other cells (cells are
    separated by two or more spaces)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) > 1:
            rows[cells[0]] = cells[1:]
    return rows
