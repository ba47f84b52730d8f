"""The tiny Qwen3-VL: a finished build is reused and a cut-short one redone, its
config has DeepStack layers, its items give 4 to 16 image tokens, and its
outputs (DeepStack features included) depend on the image, with transformers
alone (no vLLM engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ectools.model_build import check_reused_and_redone
from ectools.tiny_qwen3_vl import (
    DEEPSTACK_WIDTH_FACTOR,
    FAMILY,
    PROMPT,
    build_tiny_qwen3_vl,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl") / "model")


def test_a_build_cut_short_is_redone_and_a_finished_one_reused(tmp_path: Path) -> None:
    check_reused_and_redone(build_tiny_qwen3_vl, tmp_path / "model")


def test_the_config_has_deepstack_layers_and_their_weights(built: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(built)
    assert config.architectures == ["Qwen3VLForConditionalGeneration"]
    vision, text = config.vision_config, config.text_config
    indexes = list(vision.deepstack_visual_indexes)
    assert len(indexes) == DEEPSTACK_WIDTH_FACTOR - 1 >= 2
    assert all(0 <= index < vision.depth for index in indexes)
    # Level k is added after language-model layer k: the last level must feed a later layer.
    assert text.num_hidden_layers > len(indexes)
    assert vision.out_hidden_size == text.hidden_size
    with safe_open(str(built / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    for level in range(len(indexes)):
        assert f"model.visual.deepstack_merger_list.{level}.linear_fc2.weight" in names
    assert "lm_head.weight" in names and "model.language_model.embed_tokens.weight" in names


def _processor_inputs(built: Path) -> list[Any]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built)
    return [
        processor(text=[PROMPT], images=[FAMILY.item(index).data], return_tensors="pt")
        for index in range(FAMILY.items)
    ]


def test_the_items_give_4_to_16_image_tokens_in_several_sizes(built: Path) -> None:
    from transformers import AutoConfig

    image_token_id = AutoConfig.from_pretrained(built).image_token_id
    assert PROMPT.count("<|image_pad|>") == 1
    assert FAMILY.items == 12
    sizes = [FAMILY.item(index).data.size for index in range(FAMILY.items)]
    assert len(set(sizes)) >= 6
    assert any(width % 16 or height % 16 for width, height in sizes)
    assert FAMILY.item(3).data.tobytes() == FAMILY.item(3).data.tobytes()  # deterministic
    tokens = [int((x["input_ids"] == image_token_id).sum()) for x in _processor_inputs(built)]
    assert all(4 <= count <= 16 for count in tokens), tokens
    # One item fits vLLM's own encoder cache (max_num_batched_tokens), the pass does not.
    assert max(tokens) <= FAMILY.engine["max_num_batched_tokens"] < sum(tokens)


def test_the_outputs_depend_on_the_image_and_its_deepstack_features(built: Path) -> None:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(built).eval()
    inputs = _processor_inputs(built)
    hidden = model.config.text_config.hidden_size
    with torch.no_grad():
        features = [
            model.get_image_features(x["pixel_values"], x["image_grid_thw"]) for x in inputs[:2]
        ]
        logits = [model(**x).logits[0, -1] for x in inputs[:6]]
        next_tokens = [int(row.argmax()) for row in logits]
        # Each DeepStack level counts: silencing its merger changes the next-token logits.
        for merger in model.model.visual.deepstack_merger_list:
            hook = merger.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
            try:
                silenced = model(**inputs[0]).logits[0, -1]
            finally:
                hook.remove()
            assert not torch.allclose(silenced, logits[0], atol=1e-3)
    # Items 0 and 1 are 4 and 6 tokens; compare the 4 rows both have.
    first, second = features
    assert first.pooler_output[0].shape == (4, hidden)
    assert not torch.allclose(first.pooler_output[0], second.pooler_output[0][:4])
    assert len(first.deepstack_features) == DEEPSTACK_WIDTH_FACTOR - 1
    for level in range(DEEPSTACK_WIDTH_FACTOR - 1):
        mine, theirs = first.deepstack_features[level][0], second.deepstack_features[level][0]
        assert mine.shape == (4, hidden)
        assert not torch.allclose(mine, theirs[:4])
    assert len(set(next_tokens)) > 1, next_tokens
