"""What every tiny model builder does the same way: a folder built once, a tokenizer
trained in-process, random biases, weights saved under chosen names.

Offline and seeded throughout: the builders call these in the same order every
time, so a model folder's bytes depend only on its builder's code.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CORPUS = (
    "Question: What is in the picture? Answer: a cat sitting on a mat.",
    "Describe the image in detail. The photo shows a red car on a street.",
    "A dog runs in the park. The sky is blue and the grass is green.",
    "Question: how many people are there? Answer: two people are walking.",
)
"""What the tokenizers are trained on (a few sentences, repeated)."""

BUILDING = ".building"


def build_once(out_dir: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """The model folder `out_dir`, written by `write(out)` unless a finished one is there.

    Guarantee: a folder is taken as finished only if it holds `config.json` and
    `model.safetensors` and no `.building` marker. The marker is written before
    `write` starts and removed after it returns, so a build cut short (Ctrl-C, a
    kill while the weights, the tokenizer or the processor were being written) is
    done again, whole, by the next call; the demos keep their models across runs.
    """
    out = Path(out_dir)
    marker = out / BUILDING
    finished = (out / "config.json").exists() and (out / "model.safetensors").exists()
    if finished and not marker.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    marker.touch()
    write(out)
    marker.unlink()
    return out


def byte_bpe(
    special_tokens: Sequence[str],
    *,
    vocab_size: int = 400,
    corpus: Sequence[str] = CORPUS,
    unk_token: str | None = None,
) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus` (50 times over), with
    `special_tokens` first in its vocabulary; the caller wraps it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE(unk_token=unk_token))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(corpus) * 50, trainer=trainer)
    return core


def fast_tokenizer(core: Any, **kwargs: Any) -> Any:
    """`core` as transformers' `PreTrainedTokenizerFast` (`kwargs`: its special tokens)."""
    from transformers import PreTrainedTokenizerFast

    fast: Any = PreTrainedTokenizerFast  # untyped in transformers
    return fast(tokenizer_object=core, **kwargs)


def randomise_biases(model: Any, spared: Sequence[str] = ("norm",)) -> None:
    """Draw every 1-d parameter but the norms' (and any whose lower-cased name holds one
    of `spared`) from N(0, 0.1), in `named_parameters` order: with the large init scale
    of the builders' configs, every image then gives visibly different text."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and not any(part in name.lower() for part in spared):
                param.normal_(0.0, 0.1)


def save_model(model: Any, out: Path, renames: Sequence[tuple[str, str]] = ()) -> None:
    """Write `model`'s config, generation config and weights into `out`, each weight under
    its name with the first matching `(old prefix, new prefix)` of `renames` applied (the
    names vLLM loads, where transformers 5 holds a model under other ones)."""
    from safetensors.torch import save_file

    weights = {}
    for name, tensor in model.state_dict().items():
        saved = name
        for old, new in renames:
            if name.startswith(old):
                saved = new + name[len(old) :]
                break
        weights[saved] = tensor.contiguous()
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def check_reused_and_redone(
    build: Callable[[Path], Path], out_dir: Path, files: Sequence[str] = ()
) -> None:
    """Assert `build`'s folder protocol on `out_dir` (test tooling): a first build leaves no
    marker and holds `config.json`, `tokenizer.json`, `processor_config.json` and `files`; a
    second call reuses it (the weights untouched); a build cut short while writing the
    weights (marker left, weights truncated, tokenizer and processor gone) is done again
    and, being seeded, gives the same weights and tokenizer byte for byte."""
    out = build(out_dir)
    weights = out / "model.safetensors"
    marker = out / BUILDING
    assert not marker.exists()
    for name in ("config.json", "tokenizer.json", "processor_config.json", *files):
        assert (out / name).exists(), name
    original, tokenizer = weights.read_bytes(), (out / "tokenizer.json").read_bytes()
    finished_at = weights.stat().st_mtime_ns
    assert build(out) == out
    assert weights.stat().st_mtime_ns == finished_at, "a finished build is reused"

    marker.touch()
    with weights.open("r+b") as handle:
        handle.truncate(len(original) // 3)
    for name in ("tokenizer.json", "processor_config.json"):
        (out / name).unlink(missing_ok=True)
    assert build(out) == out
    assert not marker.exists()
    assert weights.read_bytes() == original, "seeded: the same weights again"
    assert (out / "tokenizer.json").read_bytes() == tokenizer
    assert (out / "processor_config.json").exists()
