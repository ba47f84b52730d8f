"""StreamedECCPUWorker (the shared CUDA/NPU orchestration) over a fake device runtime."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ec_core.worker_process.streamed import StreamedECCPUWorker
from ectools.streamed_contract import *  # noqa: F403  (the shared backend contract)
from ectools.streamed_contract import Factory, streamed_factory


@pytest.fixture
def make(tiny_model_dir: str, tmp_path: Path) -> Iterator[Factory]:
    yield from streamed_factory(StreamedECCPUWorker, tiny_model_dir, tmp_path)
