"""Datasets: prompt rows from files, reasoning-gym, scikit-learn's digits or spoken numbers, their order, and their
tokenisation."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from rlx.config import DataConfig
from rlx.data.digits import PROMPT as DIGITS_PROMPT
from rlx.data.digits import digits_splits
from rlx.data.files import load_rows
from rlx.data.gym import gym_splits
from rlx.data.prompts import check_prompt_lengths, prompt_token_ids
from rlx.data.rows import DataError, PromptRow
from rlx.data.sample import Sample
from rlx.data.spoken import spoken_splits
from rlx.data.stream import PromptStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_splits(config: DataConfig, tokenizer: PreTrainedTokenizerBase | None = None,
                ) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train rows, held-out eval rows) as the config describes; bad data raises DataError. Given the
    rollout's tokenizer, a prompt longer than data.max_prompt_tokens is bad data too, caught here
    rather than when its turn comes mid-run."""
    train, held_out = _read_splits(config)
    if tokenizer is not None:
        encode = partial(prompt_token_ids, tokenizer=tokenizer, system_prompt=config.system_prompt,
                         apply_chat_template=config.apply_chat_template)
        check_prompt_lengths(train + held_out, encode, config.max_prompt_tokens)
    return train, held_out


def _read_splits(config: DataConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    if config.source == "reasoning_gym":
        return gym_splits(config.task, config.task_params, config.train_size, config.eval_size, config.seed)
    if config.source == "digits":
        return digits_splits(config.train_size, config.eval_size, config.seed,
                             config.task_params.get("prompt", DIGITS_PROMPT))
    if config.source == "spoken_digits":  # clips are made under the media root, so their paths pass its check
        return spoken_splits(config.train_size, config.eval_size, config.seed, config.media_limits.root_dir,
                             config.task_params)
    keys = (config.prompt_key, config.label_key, config.metadata_key, config.media_keys, config.media_limits)
    train = load_rows(config.path, config.source, *keys)
    held_out = load_rows(config.eval_path, config.source, *keys)[: config.eval_size] if config.eval_path else []
    return train, held_out


__all__ = ["DataError", "PromptRow", "PromptStream", "Sample", "check_prompt_lengths", "load_splits"]
