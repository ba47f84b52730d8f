"""A tiny random-weight Gemma 3 (`Gemma3ForConditionalGeneration`) built offline.

A 2-layer SigLIP vision tower (hidden 128, 64 x 64 images in 8 x 8 patches: an
8 x 8 grid) is average-pooled 2 x 2 to 16 soft tokens per image, normed and
projected into a 2-layer Gemma 3 language model of width 128 (one sliding-window
layer, one global layer), all in fp32. Every image is resized to 64 x 64 (no
pan-and-scan), so every image gives 16 embeddings whatever its size.

The tokenizer is a byte-level BPE trained in-process with Gemma 3's special
tokens added (`<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, the image and turn
tokens) and with "\\n" to "\\n\\n\\n\\n" as whole tokens: vLLM's Gemma 3
processor looks them up by their text. It prepends `<bos>` as Gemma's does.
Weights are random with a large init scale and random biases, and the projector
(which transformers leaves at zeros: every image would then give the same text)
is drawn too, so that outputs depend visibly on the image. The LM head is not
tied to the embeddings (Gemma's is): with small text embeddings beside large
image ones and a large head, each image gives its own text. The weights are
saved under the published checkpoints' names (`vision_tower.vision_model.*`,
`language_model.model.*`, `language_model.lm_head.*`, `multi_modal_projector.*`),
which vLLM and transformers both load.

vLLM's Gemma 3 module imports transformers' torchvision image processor, so
the engine tests of this family need a torchvision that imports beside the CPU
torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ectools.families import Family, Item, random_image
from ectools.model_build import build_once, byte_bpe, fast_tokenizer, save_model

SEED = 0
IMAGE_SIZE = 64
PATCH = 8
MM_TOKENS_PER_IMAGE = 16
"""Soft tokens per image: the 8 x 8 patch grid average-pooled 2 x 2 to 4 x 4."""
VISION_HIDDEN = 128
TEXT_HIDDEN = 128
VOCAB_SIZE = 400
INIT_SCALE = 0.5
TEXT_EMBED_SCALE = 0.02
"""Small beside INIT_SCALE: Gemma scales text embeddings by sqrt(width), and a text
embedding that dominates the residual stream makes every answer the same."""

SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
    "<start_of_turn>",
    "<end_of_turn>",
)
"""Gemma 3's ids for the first four (pad 0, eos 1, bos 2, unk 3)."""
NEWLINES = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
"""Whole tokens in Gemma's vocabulary; vLLM's processor merges them around images."""

_CORPUS = (
    "Question: what is in the picture? Answer: a cat sitting on a mat.",
    "Describe the image in detail. The photo shows a red car on a street.",
    "A dog runs in the park. The sky is blue and the grass is green.",
    "Question: how many people are there? Answer: two people are walking.",
    "user\nWhat do you see here?\nmodel\nI see a small boat on a lake.",
)

PROMPT = "<start_of_image>Question: what is in the picture? Answer:"
"""One image: vLLM (like transformers) expands `<start_of_image>` to
"\\n\\n<start_of_image>" + 16 x `<image_soft_token>` + "<end_of_image>\\n\\n"."""

IMAGE_SIZES = (
    (64, 64),  # the model's own size
    (32, 32),  # scaled up
    (96, 96),
    (128, 64),  # wide: no pan-and-scan, squeezed to 64 x 64
    (48, 80),  # tall
    (200, 150),
    (64, 128),
    (40, 40),
    (100, 60),
    (224, 224),
    (72, 56),
    (30, 90),
)
"""(width, height) of images 0..11; each is resized to 64 x 64: 16 embeddings."""


def _train_tokenizer() -> Any:
    from tokenizers import AddedToken, processors

    core = byte_bpe(SPECIAL_TOKENS, vocab_size=VOCAB_SIZE, corpus=_CORPUS, unk_token="<unk>")
    # Whole newline tokens, matched before the byte-level split (longest first).
    core.add_tokens([AddedToken(text, normalized=False) for text in NEWLINES])
    bos = core.token_to_id("<bos>")
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    tokenizer = fast_tokenizer(
        core,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1024,
        # Gemma3Processor reads these by name.
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]},
        replace_extra_special_tokens=False,
    )
    return tokenizer


def _config(tokenizer: Any) -> Any:
    from transformers import Gemma3Config

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    special = {
        "pad_token_id": ids["<pad>"],
        "eos_token_id": ids["<eos>"],
        "bos_token_id": ids["<bos>"],
    }
    config = Gemma3Config(
        vision_config={
            "hidden_size": VISION_HIDDEN,
            "intermediate_size": VISION_HIDDEN * 2,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH,
            "vision_use_head": False,
            "layer_norm_eps": 1e-6,
        },
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": TEXT_HIDDEN * 2,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "query_pre_attn_scalar": 4,  # sharp attention: each answer looks at its image
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": 1024,
            "dtype": "float32",
            "tie_word_embeddings": False,
            **special,
        },
        mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=False,
        **special,
    )
    config.dtype = "float32"
    config.architectures = ["Gemma3ForConditionalGeneration"]
    return config


_RENAMES = (
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)
"""transformers 5's names -> the published checkpoints' (what vLLM's SigLIP loads)."""


def build_tiny_gemma3(out_dir: str | os.PathLike[str]) -> Path:
    """Build weights, config, tokenizer and processor into `out_dir` once (`build_once`:
    a build cut short is done again by the next call)."""
    return build_once(out_dir, _write)


def _write(out: Path) -> None:
    import torch
    from transformers import Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    torch.manual_seed(SEED)
    tokenizer = _train_tokenizer()
    config = _config(tokenizer)
    model: Any = Gemma3ForConditionalGeneration(config)
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        # Every matrix drawn at one large scale (the projector too: transformers leaves
        # it at zeros, and every image would then give the same text), random biases
        # and per-channel gains of the language model's norms, small text embeddings:
        # the text then depends on the image.
        for name, param in model.named_parameters():
            if "embed_tokens" in name:
                param.normal_(0.0, TEXT_EMBED_SCALE)
            elif param.dim() > 1:
                param.normal_(0.0, INIT_SCALE)
            elif "language_model" in name and "layernorm" in name:
                param.normal_(0.0, 1.0)  # Gemma's norms scale by 1 + weight
            elif "norm" not in name:
                param.normal_(0.0, 0.1)
    save_model(model, out, _RENAMES)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
            do_pan_and_scan=False,
        ),
        tokenizer=tokenizer,
        image_seq_length=MM_TOKENS_PER_IMAGE,
    )
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)


def item(index: int) -> Item:
    """Image `index` (0..11): random pixels of one of `IMAGE_SIZES`."""
    if not 0 <= index < len(IMAGE_SIZES):
        raise IndexError(f"item {index} out of range 0..{len(IMAGE_SIZES) - 1}")
    width, height = IMAGE_SIZES[index]
    return Item("image", random_image(4000 + index, width, height))


FAMILY = Family(
    name="gemma3",
    build=build_tiny_gemma3,
    prompts={"image": PROMPT},
    item=item,
    items=len(IMAGE_SIZES),
    engine={
        "max_model_len": 128,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 4,
        "limit_mm_per_prompt": {"image": 1},
        "mm_processor_kwargs": {"do_pan_and_scan": False},
    },
)
"""12 images of 16 embeddings each (192); vLLM's own encoder cache holds 32 (2 images)."""
