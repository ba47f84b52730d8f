"""Schedulers over real vLLM configs (one per role, built once per session)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from vllm.config import VllmConfig

from ec_core.layout import region_layout
from ec_core.settings import ECCPUSettings
from ec_scheduler import ECCPUScheduler
from ectools.configs import make_vllm_config

WIDTH = 128  # the tiny BLIP-2's embedding width; fp32 -> one 512-byte block per row
BLOCK = WIDTH * 4
ROLES = ("ec_both", "ec_producer", "ec_consumer")


@pytest.fixture(scope="session")
def role_configs(tiny_model_dir: str) -> dict[str, VllmConfig]:
    return {
        role: make_vllm_config(
            tiny_model_dir, role=role, extra={"ec_cpu_bytes": "1MiB"}, widths={"image": WIDTH}
        )
        for role in ROLES
    }


@pytest.fixture
def make_scheduler(role_configs: dict[str, VllmConfig]) -> Callable[..., ECCPUScheduler]:
    """`make_scheduler(role=..., blocks=..., v2=..., **extra_config)`."""

    def factory(
        role: str = "ec_both", blocks: int = 64, v2: bool = False, **extra: Any
    ) -> ECCPUScheduler:
        config = role_configs[role]
        layout = region_layout(config)
        settings = ECCPUSettings.from_extra_config(
            {"ec_cpu_bytes": blocks * BLOCK, **extra}, block_size_bytes=BLOCK
        )
        layout = replace(layout, num_blocks=blocks, settings=settings)
        scheduler = ECCPUScheduler(config, layout=layout)
        # vLLM decides V1/V2 from the environment and the platform; on this CPU
        # box it is always V1, so the V2 behaviour is selected directly.
        scheduler._empty_steps_reach_workers = v2
        return scheduler

    return factory
