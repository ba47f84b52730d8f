"""The model families the engine tests run, each as a tiny random-weight model built offline.

A `Family` says how to build its model, how to prompt it for one item of each
modality, and which item each workload index stands for (deterministic: the
same index is the same image or video in every engine, so two engines' outputs
can be compared item by item). `FAMILIES` names them all; `model_dir` builds one
into the shared cache (`build/models/` under the repository, or
`EC_CPU_TIER_MODEL_CACHE`), keyed by a digest of the builder's source, so a
changed builder never hands out a model built by its old code. Old folders are
left there: `rm -r build/models` reclaims them.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ectools import model_build
from ectools.checkout import ROOT
from ectools.tiny_blip2 import build_tiny_blip2


@dataclass(frozen=True)
class Item:
    """One multimodal item of a request: `modality` is vLLM's name for it
    ("image", "video"), `data` what goes into `multi_modal_data[modality]`."""

    modality: str
    data: Any


@dataclass(frozen=True)
class Family:
    """A model family the engine tests run.

    `build(out_dir)` writes a complete model folder (weights, config, tokenizer,
    processor) and returns it; it is idempotent and offline. `prompts[modality]`
    is a prompt holding exactly one placeholder for an item of that modality.
    `item(index)` is the item a workload index stands for. `engine` holds the
    `LLM(...)` arguments the family needs beyond the runner's defaults (for
    instance `max_model_len`, `limit_mm_per_prompt`); `max_num_batched_tokens`
    there also bounds vLLM's own encoder cache, which the tests keep smaller
    than a pass's items.
    """

    name: str
    build: Callable[[Path], Path]
    prompts: Mapping[str, str]
    item: Callable[[int], Item]
    items: int
    """How many distinct items the engine tests' passes use (indices 0..items-1)."""
    engine: Mapping[str, Any] = field(default_factory=dict)

    def prompt(self, index: int) -> dict[str, Any]:
        """The `generate` prompt for workload index `index`."""
        item = self.item(index)
        return {
            "prompt": self.prompts[item.modality],
            "multi_modal_data": {item.modality: item.data},
        }


def random_image(seed: int, width: int, height: int) -> Any:
    """A deterministic random RGB image of `width` x `height` pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


BLIP2_PROMPT = "Question: what is in the picture? Answer:"

BLIP2 = Family(
    name="blip2",
    build=build_tiny_blip2,
    prompts={"image": BLIP2_PROMPT},
    item=lambda index: Item("image", random_image(1000 + index, 32, 32)),
    items=10,
    engine={
        "max_model_len": 128,
        "max_num_batched_tokens": 32,
        "limit_mm_per_prompt": {"image": 1},
    },
)
"""The small case: 8 embeddings of width 128 per 32 x 32 image; vLLM's own encoder
cache holds 4 of them."""


_REGISTRY: dict[str, str] = {
    "blip2": "ectools.families:BLIP2",
    "qwen2_5_vl": "ectools.tiny_qwen2_5_vl:FAMILY",
    "qwen3_vl": "ectools.tiny_qwen3_vl:FAMILY",
    "gemma3": "ectools.tiny_gemma3:FAMILY",
}
"""Family name -> `module:attribute`; imported when asked for, so a family's
builder (and what it imports) loads only where it is used."""


def family(name: str) -> Family:
    """The family registered as `name`."""
    try:
        where = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(_REGISTRY)}") from None
    module, _, attribute = where.partition(":")
    found = getattr(importlib.import_module(module), attribute)
    assert isinstance(found, Family)
    return found


def cache_root() -> Path:
    """Where built models are kept between runs."""
    configured = os.environ.get("EC_CPU_TIER_MODEL_CACHE")
    return Path(configured) if configured else ROOT / "build" / "models"


def model_dir(name: str, root: Path | None = None) -> Path:
    """The folder of family `name`'s tiny model, built there first if needed.

    The folder's name carries a digest of the builder's source module and of
    `ectools.model_build`, so editing a builder builds a new model rather than
    reusing the old one.
    """
    chosen = family(name)
    sources = [inspect.getsource(inspect.getmodule(chosen.build) or chosen.build)]
    sources.append(inspect.getsource(model_build))  # what every builder calls
    digest = hashlib.sha256("\n".join(sources).encode()).hexdigest()[:12]
    out = (root or cache_root()) / f"{name}-{digest}"
    return chosen.build(out)
