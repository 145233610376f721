"""A Hugging Face folder into a model and tokenizer (`rlx.models` re-exports these).

Apart from `rlx.models`, whose built-in models' builders load the base model they start from:
they import this, not the package that lists them.
"""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: Path):
    """The folder's tokenizer, given a pad token (its EOS) if it lacks one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# A released Qwen-Omni folder holds the thinker (text out) beside the talker that speaks: rlx runs
# and trains the thinker alone, and never reads the talker's weights.
OMNI_COMPOSITES = frozenset({"qwen2_5_omni", "qwen3_omni_moe"})


def load_model_config(path: Path):
    """The `transformers` config of the model rlx runs from a folder: a released Omni folder's thinker's."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return config.thinker_config if config.model_type in OMNI_COMPOSITES else config


def load_pretrained(path: Path, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) from a Hugging Face folder: a causal LM, an image-text-to-text model
    (one with a `vision_config`, e.g. LLaVA, Qwen-VL or a Qwen-Omni thinker, alone or out of a
    released thinker + talker folder) or an audio-text model (one with an `audio_config`, e.g.
    AudioFlamingo3, which transformers files under its sequence-to-sequence auto class) whose
    forward also takes media."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

    tokenizer = load_tokenizer(path)
    config = load_model_config(path)
    auto = (AutoModelForImageTextToText if hasattr(config, "vision_config")
            else AutoModelForSeq2SeqLM if hasattr(config, "audio_config") else AutoModelForCausalLM)
    # a thinker's base_model_prefix is "thinker": transformers strips it from a released folder's keys
    model = auto.from_pretrained(path, config=config, dtype=getattr(torch, dtype), use_safetensors=True).to(device)
    return model, tokenizer
