"""A tiny random-weight Qwen3-VL (dense) with DeepStack, built offline.

The vision tower hands two of its intermediate layers' merged features to the
language model's first layers besides its last layer's (DeepStack), so the
encoder output vLLM's `embed_multimodal` returns (and an EC connector stores)
is `DEEPSTACK_WIDTH_FACTOR` times the language model's embedding width.

The tokenizer is a byte-level BPE trained in-process with Qwen's chat and
vision tokens added. The image processor (Qwen2-VL's, as Qwen3-VL checkpoints
use) keeps images between 4 and 16 tokens; the processor class also needs a
video processor, which goes with it. Both processors need torchvision.
Weights are random with a large init scale and random biases so that outputs
depend visibly on the image, its DeepStack features included.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ectools.families import Family, Item, random_image
from ectools.model_build import build_once, byte_bpe, fast_tokenizer, randomise_biases, save_model

SEED = 0
PATCH = 16
MERGE = 2
VISION_HIDDEN = 128
VISION_DEPTH = 4
DEEPSTACK_VISUAL_INDEXES = (1, 2)
TEXT_HIDDEN = 128
TEXT_LAYERS = 3
"""One more than the DeepStack levels: level k is added to the output of language-model
layer k, so with as many layers as levels the last level would reach no generated token."""
DEEPSTACK_GAIN = 8.0
"""The DeepStack mergers' outputs are scaled up by this much: at the init scale the
language model's residual stream drowns them and few outputs depend on them."""
VOCAB_SIZE = 400
MIN_TOKENS = 4
MAX_TOKENS = 16
"""Image tokens per image: each covers (PATCH * MERGE)^2 = 32 x 32 resized pixels."""

DEEPSTACK_WIDTH_FACTOR = 1 + len(DEEPSTACK_VISUAL_INDEXES)
"""Encoder output width over the language model's embedding width (3)."""

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
    "What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
)
"""One image placeholder, as vLLM's Qwen3-VL processor expands it."""

IMAGE_SIZES = (
    (64, 64),
    (96, 64),
    (64, 128),
    (100, 70),
    (128, 128),
    (150, 50),
    (77, 120),
    (96, 96),
    (45, 90),
    (128, 96),
    (200, 40),
    (111, 83),
)
"""(width, height) of the items, several of them off the 16-pixel patch grid."""


def _train_tokenizer() -> Any:
    tokenizer = fast_tokenizer(
        byte_bpe(SPECIAL_TOKENS, vocab_size=VOCAB_SIZE),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=1024,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


def _config(tokenizer: Any) -> Any:
    from transformers import Qwen3VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    heads = TEXT_HIDDEN // 32
    head_dim = TEXT_HIDDEN // heads
    # One rotary half of a head, split over (time, height, width) positions.
    spatial = head_dim // 6
    mrope_section = [head_dim // 2 - 2 * spatial, spatial, spatial]
    config = Qwen3VLConfig(
        vision_config={
            "depth": VISION_DEPTH,
            "hidden_size": VISION_HIDDEN,
            "intermediate_size": VISION_HIDDEN * 2,
            "num_heads": VISION_HIDDEN // 64,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
            "out_hidden_size": TEXT_HIDDEN,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": list(DEEPSTACK_VISUAL_INDEXES),
            "initializer_range": 0.5,
        },
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": TEXT_HIDDEN * 3,
            "num_hidden_layers": TEXT_LAYERS,
            "num_attention_heads": heads,
            "num_key_value_heads": heads // 2,
            "head_dim": head_dim,
            "max_position_embeddings": 1024,
            "initializer_range": 0.5,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": mrope_section,
                "mrope_interleaved": True,
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "dtype": "float32",
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.dtype = "float32"
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    return config


def _processor(tokenizer: Any) -> Any:
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    unit = (PATCH * MERGE) ** 2
    common: dict[str, Any] = {
        "patch_size": PATCH,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": MIN_TOKENS * unit, "longest_edge": MAX_TOKENS * unit}, **common
    )
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": MIN_TOKENS * unit, "longest_edge": 2 * MAX_TOKENS * unit},
        **common,
    )
    processor: Any = Qwen3VLProcessor  # untyped in transformers
    return processor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor
    )


def _randomise(model: Any) -> None:
    """Random biases, so that every image gives visibly different text, and louder
    DeepStack mergers, so that their features visibly count too."""
    import torch

    randomise_biases(model)
    with torch.no_grad():
        for merger in model.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.mul_(DEEPSTACK_GAIN)
            merger.linear_fc2.bias.mul_(DEEPSTACK_GAIN)


def build_tiny_qwen3_vl(out_dir: str | os.PathLike[str]) -> Path:
    """Build weights, config, tokenizer and processors into `out_dir` once (`build_once`:
    a build cut short is done again by the next call)."""
    return build_once(out_dir, _write)


def _write(out: Path) -> None:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(SEED)
    tokenizer = _train_tokenizer()
    config = _config(tokenizer)
    model_class: Any = Qwen3VLForConditionalGeneration  # untyped in transformers
    model = model_class(config).to(torch.float32).eval()
    _randomise(model)
    # transformers 5 names the weights as Qwen3-VL checkpoints do (`model.visual.`,
    # `model.language_model.`, `lm_head.`), which vLLM's loader maps itself.
    save_model(model, out)
    tokenizer.save_pretrained(out)
    _processor(tokenizer).save_pretrained(out)


def item(index: int) -> Item:
    """Workload index `index`: a random image of one of `IMAGE_SIZES` (4 to 16 tokens)."""
    width, height = IMAGE_SIZES[index % len(IMAGE_SIZES)]
    return Item("image", random_image(3000 + index, width, height))


FAMILY = Family(
    name="qwen3_vl",
    build=build_tiny_qwen3_vl,
    prompts={"image": PROMPT},
    item=item,
    items=len(IMAGE_SIZES),
    engine={
        "max_model_len": 256,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 4,
        "limit_mm_per_prompt": {"image": 1, "video": 0},
    },
)
"""4 to 16 embeddings of width 3 x 128 per image; vLLM's encoder cache (64 embeddings)
holds a few of the 12 items, not all."""
