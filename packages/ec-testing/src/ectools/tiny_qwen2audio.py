"""A tiny random-weight Qwen2-Audio built offline.

BLIP-2 declares no pre-computed-embedding fields, so a request cannot name its
image by metadata alone; Qwen2-Audio can: `audio_num_tokens` sizes the
placeholder and, on an EC consumer, `audio_embeds` may be left out (the
connector is to supply it). Its processor needs no torchvision (Qwen2-VL's
video processor does). The tokenizer is a byte-level BPE trained in-process
with the audio tokens added.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ectools.model_build import build_once, byte_bpe, fast_tokenizer, save_model

AUDIO_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
PROMPT = "<|audio_bos|><|AUDIO|><|audio_eos|>Question: what is in the picture? Answer:"
EMBEDS_PER_AUDIO = 50
"""Of 2 s of audio: 200 mel frames, halved by the encoder's stride and again by its pooling."""


def build_tiny_qwen2audio(out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build weights, tokenizer and processor into `out_dir` once (`build_once`)."""
    return build_once(out_dir, lambda out: _write(out, seed))


def _write(out: Path, seed: int) -> None:
    import torch
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    torch.manual_seed(seed)
    core = byte_bpe(["<|endoftext|>", *AUDIO_TOKENS])
    tokenizer = fast_tokenizer(
        core,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=1024,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(AUDIO_TOKENS)})
    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = Qwen2AudioConfig(
        audio_config={
            "num_mel_bins": 80,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "d_model": 64,
            "max_source_positions": 1500,
        },
        text_config={
            "model_type": "qwen2",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 1024,
            **special,
        },
        audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
        **special,
    )
    config.dtype = "float32"
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32).eval()
    # Qwen's checkpoints name the weights as vLLM loads them; transformers 5 holds
    # them under other prefixes and does not write them back in that form.
    renames = (
        ("model.audio_tower.", "audio_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    )
    save_model(model, out, renames)
    processor = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=80),
        tokenizer=tokenizer,
    )
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)


def run_metadata_only(model_dir: str, region_dir: str, role: str = "ec_both") -> dict[str, Any]:
    """Send an engine with the connector one audio given by metadata alone (a UUID
    the region does not hold), then one with real audio; what each gave back."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    llm = LLM(
        model=model_dir,
        tokenizer=model_dir,
        dtype="float32",
        enable_prefix_caching=False,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        max_num_seqs=2,
        limit_mm_per_prompt={"audio": 1},
        enforce_eager=True,
        seed=0,
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECCPUTierConnector",
            ec_role=role,  # type: ignore[arg-type]
            ec_connector_extra_config={"ec_cpu_bytes": "4MiB", "ec_cpu_dir": region_dir},
        ),
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    result: dict[str, Any] = {}
    metadata_only = {
        "prompt": PROMPT,
        "multi_modal_data": {"audio": {"audio_num_tokens": torch.tensor([EMBEDS_PER_AUDIO])}},
        "multi_modal_uuids": {"audio": ["never-encoded-anywhere"]},
    }
    try:
        out = llm.generate([metadata_only], sampling, use_tqdm=False)[0]
        result["metadata_only"] = {
            "finish_reason": out.outputs[0].finish_reason,
            "token_ids": list(out.outputs[0].token_ids),
        }
    except Exception as error:  # the engine died
        result["metadata_only"] = {"error": f"{type(error).__name__}: {error}"}
    audio = np.random.default_rng(0).uniform(-0.5, 0.5, 32000).astype(np.float32)
    with_audio = {"prompt": PROMPT, "multi_modal_data": {"audio": (audio, 16000)}}
    try:
        out = llm.generate([with_audio], sampling, use_tqdm=False)[0]
        result["with_audio"] = {
            "finish_reason": out.outputs[0].finish_reason,
            "token_ids": list(out.outputs[0].token_ids),
        }
    except Exception as error:
        result["with_audio"] = {"error": f"{type(error).__name__}: {error}"}
    llm.llm_engine.engine_core.shutdown()  # its processes end with it
    return result


if __name__ == "__main__":
    found = run_metadata_only(*sys.argv[1:])
    print("RESULT " + json.dumps(found), flush=True)
