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


def build_tiny(path: str | Path, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0) -> Path:
    """Write a tiny model and its character tokenizer as a Hugging Face folder."""
    path = Path(path)
    tokenizer = char_tokenizer()
    model = tiny_model(len(tokenizer), hidden=hidden, layers=layers, heads=heads, seed=seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
