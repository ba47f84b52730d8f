"""Fixtures of the engine tests: the tiny BLIP-2 and the run without connector."""

from __future__ import annotations

import pytest

from ectools.engine import TEST_PASSES, EngineSpec, run_in_subprocess
from ectools.tiny_blip2 import build_tiny_blip2


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_blip2(tmp_path_factory.mktemp("tiny-blip2")))


@pytest.fixture(scope="session")
def baseline(model_dir: str) -> list[list[list[int]]]:
    """Token ids per pass of an engine without the connector."""
    result = run_in_subprocess(EngineSpec(model_dir=model_dir, passes=TEST_PASSES))
    passes: list[list[list[int]]] = result["passes"]
    assert len({tuple(tokens) for tokens in passes[0]}) >= 8, "images must give distinct outputs"
    return passes
