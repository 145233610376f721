"""Tiny Llama-style models with an offline character tokenizer, built from a config in code.

They make every test hermetic: no hub, no download, a model small enough to train in seconds.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers costs seconds to import: only the functions that build need it
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus pad/bos/eos/unk."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model(vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).float()


MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")


def tiny_moe_model(family: str, vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                   experts: int = 8, top_k: int = 2, seed: int = 0):
    """A tiny mixture-of-experts causal LM of one of `MOE_FAMILIES` (random init, fp32)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    shared = {"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": hidden * 2,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
              "max_position_embeddings": 512, "num_experts_per_tok": top_k, "pad_token_id": 0, "bos_token_id": 1,
              "eos_token_id": 2, "tie_word_embeddings": False}
    if family == "mixtral":
        config = MixtralConfig(num_local_experts=experts, **shared)
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=hidden, head_dim=hidden // heads,
                                norm_topk_prob=True, **shared)
    elif family == "olmoe":
        config = OlmoeConfig(num_experts=experts, norm_topk_prob=False, **shared)
    elif family == "qwen2_moe":  # with a shared expert beside the routed ones
        config = Qwen2MoeConfig(num_experts=experts, moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden,
                                norm_topk_prob=False, **shared)
    else:
        raise ValueError(f"family={family!r}: tiny MoE models come in {', '.join(MOE_FAMILIES)}")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float()


def build_tiny(path: str | Path, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0,
               moe_family: str | None = None) -> Path:
    """Write a tiny model (a MoE one of `moe_family`, else Llama) and its character tokenizer as a
    Hugging Face folder."""
    path = Path(path)
    tokenizer = char_tokenizer()
    if moe_family is None:
        model = tiny_model(len(tokenizer), hidden=hidden, layers=layers, heads=heads, seed=seed)
    else:
        model = tiny_moe_model(moe_family, len(tokenizer), hidden=hidden, layers=layers, heads=heads, seed=seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
