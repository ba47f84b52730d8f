"""The engine tests' model families (`ectools.families`), without an engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ectools.families import _REGISTRY, family, model_dir


@pytest.mark.parametrize("name", sorted(_REGISTRY))
def test_every_family_resolves_and_its_items_are_the_same_every_time(name: str) -> None:
    chosen = family(name)
    assert chosen.name == name and chosen.items >= 10
    for index in range(chosen.items):
        first, again = chosen.item(index), chosen.item(index)
        assert first.modality == again.modality and first.modality in chosen.prompts
        assert np.array_equal(_pixels(first.data), _pixels(again.data))
        prompt = chosen.prompt(index)
        assert set(prompt["multi_modal_data"]) == {first.modality}


def _pixels(data: object) -> np.ndarray:
    if isinstance(data, tuple):  # a video with its metadata
        data = data[0]
    return np.asarray(data)


def test_an_unknown_family_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown model family 'llava'.*'qwen3_vl'"):
        family("llava")


def test_a_built_model_is_kept_under_a_digest_of_its_builder(tmp_path: Path) -> None:
    built = model_dir("blip2", root=tmp_path)
    assert built.parent == tmp_path and built.name.startswith("blip2-")
    assert (built / "model.safetensors").exists()
    weights = (built / "model.safetensors").stat().st_mtime_ns
    assert model_dir("blip2", root=tmp_path) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == weights, "reused"
