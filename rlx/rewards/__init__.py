"""Rewards: built-in rule scorers, custom `module:function` rewards, and safe scoring."""

from __future__ import annotations

import importlib

from rlx.config import ConfigError
from rlx.rewards.builtin import REWARDS, RewardFn
from rlx.rewards.safe import RewardOutcome, score_safely


def load_custom_reward(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"reward.name={spec!r}: cannot load {attr!r} from module {module_name!r}: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"reward.name={spec!r} is not callable")
    return fn


def build_reward(name: str, extract: str) -> RewardFn:
    """A built-in reward by name, or `package.module:function` (called as fn(completion, label, metadata))."""
    if ":" in name:
        return load_custom_reward(name)
    if name not in REWARDS:
        raise ConfigError(f"reward.name={name!r} is unknown; use one of {REWARDS.names()} or module:function")
    return REWARDS.get(name)(extract)


__all__ = ["REWARDS", "RewardFn", "RewardOutcome", "build_reward", "load_custom_reward", "score_safely"]
