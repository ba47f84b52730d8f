"""Labelled stand-ins for the few vLLM names a backend worker imports, for hosts without vLLM.

The device checks run on GPU hosts that have PyTorch but no vLLM (its wheels
are too large to carry there, and the host has no network). The worker's copy
path does not need vLLM at all; only its imports do:

* `vllm.logger.init_logger` (every module logs through it);
* `vllm.distributed.ec_transfer.ec_connector.base`'s two metadata base classes
  (the scheduler/worker payloads subclass them);
* a `VllmConfig`: the worker reads only its `ec_transfer_config`,
  `model_config.dtype` / `get_inputs_embeds_size()`,
  `parallel_config.data_parallel_index` and `instance_id`.

`install()` registers modules under those names, each marked
`EC_STANDIN = True` and with a `__version__` that says "standin", and only
when vLLM is not importable: it never shadows a real vLLM. Nothing in the
packages imports this module; it lives with the tools.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

STANDIN_VERSION = "0.33.0+ec.standin"
"""Passes ec-core's version gate; says plainly what it is."""

NAMES = (
    "vllm.logger.init_logger",
    "vllm.distributed.ec_transfer.ec_connector.base.ECConnectorMetadata",
    "vllm.distributed.ec_transfer.ec_connector.base.ECConnectorWorkerMetadata",
    "vllm.config.VllmConfig (the fields the worker reads)",
)
"""What the stand-ins provide, for the notice a check prints."""


def vllm_missing() -> bool:
    """True when no real vLLM can be imported here (stand-ins already installed count as none)."""
    module = sys.modules.get("vllm")
    if module is not None:
        return bool(getattr(module, "EC_STANDIN", False))
    return importlib.util.find_spec("vllm") is None


class ECConnectorMetadata(ABC):  # noqa: B024  (a marker base, like vLLM's)
    """Stand-in: the base of what the scheduler sends the workers."""


class ECConnectorWorkerMetadata(ABC):
    """Stand-in: the base of what a worker reports; vLLM folds them with `aggregate`."""

    @abstractmethod
    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata: ...


def init_logger(name: str) -> logging.Logger:
    """Stand-in for vLLM's logger factory: a plain `logging` logger of that name."""
    return logging.getLogger(name)


def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name, f"ec checks stand-in for {name} (vLLM is not installed)")
    module.EC_STANDIN = True  # type: ignore[attr-defined]
    for key, value in attributes.items():
        setattr(module, key, value)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def install() -> bool:
    """Register the stand-in modules if vLLM is absent; True when they are (now) in use."""
    if not vllm_missing():
        return False
    if "vllm" in sys.modules:
        return True  # installed by an earlier call
    _module("vllm", __version__=STANDIN_VERSION)
    _module("vllm.logger", init_logger=init_logger)
    _module("vllm.distributed")
    _module("vllm.distributed.ec_transfer")
    _module("vllm.distributed.ec_transfer.ec_connector")
    _module(
        "vllm.distributed.ec_transfer.ec_connector.base",
        ECConnectorMetadata=ECConnectorMetadata,
        ECConnectorWorkerMetadata=ECConnectorWorkerMetadata,
    )
    return True


@dataclass
class StandinECTransferConfig:
    """The `ec_transfer_config` fields the worker reads."""

    ec_connector_extra_config: dict[str, Any]
    ec_role: str = "ec_both"
    engine_id: str = "ec-device-checks"

    @property
    def is_ec_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_ec_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")


@dataclass
class StandinModelConfig:
    """The `model_config` fields the worker reads."""

    dtype: torch.dtype
    embed_width: int

    def get_inputs_embeds_size(self) -> int:
        return self.embed_width


@dataclass
class StandinParallelConfig:
    data_parallel_index: int = 0


@dataclass
class StandinVllmConfig:
    """Stand-in for `VllmConfig`: exactly the fields `ECCPUWorker` reads, nothing more."""

    ec_transfer_config: StandinECTransferConfig
    model_config: StandinModelConfig
    parallel_config: StandinParallelConfig = field(default_factory=StandinParallelConfig)
    instance_id: str = "ec-device-checks"


def standin_config(dtype: torch.dtype, width: int, extra: dict[str, Any]) -> StandinVllmConfig:
    """A config for one worker whose region rows are `width` elements of `dtype`."""
    return StandinVllmConfig(
        ec_transfer_config=StandinECTransferConfig(ec_connector_extra_config=dict(extra)),
        model_config=StandinModelConfig(dtype=dtype, embed_width=width),
    )
