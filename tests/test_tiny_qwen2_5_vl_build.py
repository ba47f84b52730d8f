"""The tiny Qwen2.5-VL builds offline, is reused once finished and rebuilt when its build
was cut short, and (run by transformers alone, no vLLM engine) gives outputs that
depend on the image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ectools.families import Family
from ectools.model_build import check_reused_and_redone
from ectools.tiny_qwen2_5_vl import FAMILY, build_tiny_qwen2_5_vl


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "model")


def test_a_build_cut_short_is_redone_and_a_finished_one_reused(tmp_path: Path) -> None:
    check_reused_and_redone(build_tiny_qwen2_5_vl, tmp_path / "model")


def test_the_family_describes_twelve_items_of_both_modalities() -> None:
    assert isinstance(FAMILY, Family)
    assert FAMILY.name == "qwen2_5_vl"
    assert FAMILY.items == 12
    for modality, placeholder in (("image", "<|image_pad|>"), ("video", "<|video_pad|>")):
        assert FAMILY.prompts[modality].count(placeholder) == 1
    modalities = [FAMILY.item(i).modality for i in range(FAMILY.items)]
    assert modalities == ["image"] * 9 + ["video"] * 3
    sizes = {FAMILY.item(i).data.size for i in range(9)}
    assert len(sizes) >= 6
    assert any(w % 28 or h % 28 for w, h in sizes)  # some off the 28-pixel grid
    for i in range(9, 12):
        frames, metadata = FAMILY.item(i).data
        assert frames.ndim == 4 and frames.shape[-1] == 3 and 2 <= frames.shape[0] <= 4
        assert metadata["total_num_frames"] == frames.shape[0]
    # Deterministic: the same index is the same item.
    first, again = FAMILY.item(1).data, FAMILY.item(1).data
    assert first.tobytes() == again.tobytes()
    assert (FAMILY.item(10).data[0] == FAMILY.item(10).data[0]).all()
    engine = FAMILY.engine
    assert engine["limit_mm_per_prompt"] == {"image": 1, "video": 1}
    assert engine["max_num_batched_tokens"] >= engine["max_num_seqs"]


def _inputs(processor: Any, index: int) -> Any:
    from transformers.video_utils import VideoMetadata

    item = FAMILY.item(index)
    prompt = FAMILY.prompts[item.modality]
    if item.modality == "image":
        return processor(text=[prompt], images=[item.data], return_tensors="pt")
    frames, metadata = item.data
    # vLLM hands transformers the metadata without its own `do_sample_frames` key.
    fields = {k: v for k, v in metadata.items() if k != "do_sample_frames"}
    return processor(
        text=[prompt],
        videos=[frames],
        video_metadata=[VideoMetadata(**fields)],
        return_tensors="pt",
    )


RUN = (0, 2, 5, 7, 9, 11)
"""The items whose greedy next token the model computes (images and videos)."""


def test_outputs_depend_on_the_image(built: Path) -> None:
    import torch
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from ectools.families import random_image

    processor = AutoProcessor.from_pretrained(built)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(built, dtype=torch.float32).eval()
    pad_ids = {
        processor.tokenizer.convert_tokens_to_ids(token)
        for token in ("<|image_pad|>", "<|video_pad|>")
    }
    placeholders: list[int] = []
    next_tokens: list[int] = []
    with torch.no_grad():
        # The vision tower's embeddings of two images of one size differ.
        pair = processor.image_processor(
            images=[random_image(1, 84, 84), random_image(2, 84, 84)], return_tensors="pt"
        )
        first, second = model.get_image_features(
            pair["pixel_values"], pair["image_grid_thw"], return_dict=True
        ).pooler_output
        assert first.shape == second.shape == (9, 128)
        assert (first - second).abs().mean() > 0.1 * first.abs().mean()

        for index in range(FAMILY.items):
            inputs = _inputs(processor, index)
            placeholders.append(sum(t in pad_ids for t in inputs["input_ids"][0].tolist()))
            if index in RUN:
                next_tokens.append(int(model(**inputs).logits[0, -1].argmax()))

    # One embedding per 28 x 28 pixels: 4 to 16 per image, 4 per pair of video frames.
    assert all(4 <= count <= 16 for count in placeholders[:9]), placeholders
    assert placeholders[9:] == [4, 8, 8]
    # vLLM's own encoder cache (max_num_batched_tokens embeddings) holds a few items only.
    assert sum(placeholders) > 3 * FAMILY.engine["max_num_batched_tokens"]
    assert len(set(next_tokens)) >= len(RUN) - 1, next_tokens
