"""Checks every backend package must pass, shared by their test modules."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory


def check_connector_resolution(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    module_path: str,
    connector_class: type[ECConnectorBase],
    register: Callable[[], None],
) -> None:
    """vLLM's factory resolves `name` by module path, then, after the plugin
    ran (twice: vLLM loads plugins repeatedly), by the registered name alone."""
    registry = dict(ECConnectorFactory._registry)
    registry.pop(name, None)
    monkeypatch.setattr(ECConnectorFactory, "_registry", registry)
    by_path = ECTransferConfig(
        ec_connector=name, ec_role="ec_both", ec_connector_module_path=module_path
    )
    assert ECConnectorFactory.get_connector_class(by_path) is connector_class
    register()
    register()
    assert name in ECConnectorFactory._registry
    by_name = ECTransferConfig(ec_connector=name, ec_role="ec_both")
    assert ECConnectorFactory.get_connector_class(by_name) is connector_class


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
