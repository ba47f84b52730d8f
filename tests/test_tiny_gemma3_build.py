"""The tiny Gemma 3 is built offline into a folder vLLM loads (published weight names,
newline tokens, Gemma 3's processor), reused when finished and rebuilt, identically,
when cut short; its answers depend on the image (checked with transformers alone)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ectools.model_build import check_reused_and_redone
from ectools.tiny_gemma3 import FAMILY, MM_TOKENS_PER_IMAGE, PROMPT, build_tiny_gemma3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "model")


def test_a_build_cut_short_is_redone_and_a_finished_one_reused(
    model_dir: Path, tmp_path: Path
) -> None:
    out = Path(shutil.copytree(model_dir, tmp_path / "model"))
    check_reused_and_redone(build_tiny_gemma3, out)


def test_the_folder_holds_what_vllm_looks_up(model_dir: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoProcessor

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert config["mm_tokens_per_image"] == MM_TOKENS_PER_IMAGE
    with safe_open(str(model_dir / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    prefixes = {name.split(".")[0] for name in names}
    assert prefixes == {"vision_tower", "multi_modal_projector", "language_model"}
    assert all(n.startswith("vision_tower.vision_model.") for n in names if "vision" in n)

    processor: Any = AutoProcessor.from_pretrained(model_dir)  # type: ignore[no-untyped-call]
    tokenizer = processor.tokenizer
    vocab = tokenizer.get_vocab()
    assert all(text in vocab for text in ("\n", "\n\n", "\n\n\n", "\n\n\n\n"))
    assert vocab[tokenizer.image_token] == config["image_token_index"]
    assert vocab[tokenizer.boi_token] == config["boi_token_index"]
    assert PROMPT.count(tokenizer.boi_token) == 1
    image = FAMILY.item(3).data  # wide: still one image of 16 tokens (no pan-and-scan)
    batch = processor(text=[PROMPT], images=[[image]], return_tensors="pt")
    ids = batch["input_ids"][0].tolist()
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(config["image_token_index"]) == MM_TOKENS_PER_IMAGE
    assert tuple(batch["pixel_values"].shape) == (1, 3, 64, 64)


def test_the_answers_depend_on_the_image(model_dir: Path) -> None:
    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor: Any = AutoProcessor.from_pretrained(model_dir)  # type: ignore[no-untyped-call]
    loaded: Any = Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    model, info = loaded
    assert not any(info.values()), info  # every saved weight loaded, none missing
    model.eval()
    batches = [
        processor(text=[PROMPT], images=[[FAMILY.item(index).data]], return_tensors="pt")
        for index in range(6)
    ]
    with torch.no_grad():
        features = [
            model.model.get_image_features(pixel_values=batch["pixel_values"])
            for batch in batches[:2]
        ]
        first, second = (f.pooler_output for f in features)
        assert first.shape[-2:] == (MM_TOKENS_PER_IMAGE, model.config.text_config.hidden_size)
        assert (first - second).abs().mean() > 0.1 * first.abs().mean()
        next_tokens = [int(model(**batch).logits[0, -1].argmax()) for batch in batches]
    assert len(set(next_tokens)) > 1, next_tokens
