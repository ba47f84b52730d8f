"""Fixtures of the engine tests: the tiny BLIP-2 and the run without connector."""

from __future__ import annotations

import pytest

from ectools.engine import TEST_PASSES, EngineSpec, run_in_subprocess
from ectools.tiny_blip2 import TWO_WAY_SPLITTABLE, build_tiny_blip2


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


@pytest.fixture(scope="session")
def tp2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny BLIP-2 with two vision heads: it runs with tensor_parallel_size=2."""
    return str(build_tiny_blip2(tmp_path_factory.mktemp("tiny-blip2-tp2"), TWO_WAY_SPLITTABLE))


@pytest.fixture(scope="session")
def tp2_baseline(tp2_model_dir: str) -> list[list[list[int]]]:
    """Token ids per pass of a TP=2 engine without the connector."""
    spec = EngineSpec(
        model_dir=tp2_model_dir, passes=TEST_PASSES, tensor_parallel_size=2, multiprocess=False
    )
    passes: list[list[list[int]]] = run_in_subprocess(spec)["passes"]
    assert len({tuple(tokens) for tokens in passes[0]}) >= 8, "images must give distinct outputs"
    return passes
