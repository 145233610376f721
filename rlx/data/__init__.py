"""Datasets: prompt rows from files or reasoning-gym, their order, and their tokenisation."""

from __future__ import annotations

from rlx.config import DataConfig
from rlx.data.files import load_rows
from rlx.data.gym import gym_splits
from rlx.data.rows import DataError, PromptRow
from rlx.data.sample import Sample
from rlx.data.stream import PromptStream


def load_splits(config: DataConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train rows, held-out eval rows) as the config describes; bad data raises DataError."""
    if config.source == "reasoning_gym":
        return gym_splits(config.task, config.task_params, config.train_size, config.eval_size, config.seed)
    keys = (config.prompt_key, config.label_key, config.metadata_key)
    train = load_rows(config.path, config.source, *keys)
    held_out = load_rows(config.eval_path, config.source, *keys)[: config.eval_size] if config.eval_path else []
    return train, held_out


__all__ = ["DataError", "PromptRow", "PromptStream", "Sample", "load_splits"]
