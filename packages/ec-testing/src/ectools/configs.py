"""Real vLLM configs for tests, from a model folder on disk (no hub)."""

from __future__ import annotations

import contextlib
import os
from typing import Any
from unittest import mock

from vllm.config import ECTransferConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs


def make_vllm_config(
    model_dir: str | os.PathLike[str],
    *,
    role: str | None = "ec_both",
    extra: dict[str, Any] | None = None,
    connector: str = "ECCPUTierConnector",
    module_path: str | None = None,
    widths: dict[str, int] | None = None,
    early_checks: bool = False,
    **engine_kwargs: Any,
) -> VllmConfig:
    """A VllmConfig for `model_dir` with an EC transfer config attached.

    `widths` plays the part of vLLM's start-up measurement of encoder output
    widths (which needs a loaded model); `engine_kwargs` go to EngineArgs.
    The plugin's early configuration check (`ec_scheduler.shell.early_checks`)
    runs only with `early_checks=True`: tests of the later layers build
    configs with bad settings on purpose, to see those layers refuse them.
    """
    ec_config = None
    if role is not None:
        ec_config = ECTransferConfig(
            ec_connector=connector,
            ec_role=role,  # type: ignore[arg-type]
            ec_connector_module_path=module_path,
            ec_connector_extra_config=dict(extra or {}),
        )
    kwargs: dict[str, Any] = {
        "model": os.fspath(model_dir),
        "dtype": "float32",
        "max_model_len": 128,
        "skip_tokenizer_init": True,
        "enable_prefix_caching": False,
        "enforce_eager": True,
    }
    kwargs.update(engine_kwargs)
    from ec_scheduler.shell import early_checks as checks

    with (
        contextlib.nullcontext()
        if early_checks
        else mock.patch.object(checks, "check", return_value=None)
    ):
        config = EngineArgs(ec_transfer_config=ec_config, **kwargs).create_engine_config()
    if config.ec_transfer_config is not None and widths is not None:
        config.ec_transfer_config.mm_encoder_output_widths = dict(widths)
    return config
