"""Built-in rule rewards. Every reward maps (completion, label, metadata) -> score in [0, 1]."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from rlx.registry import Registry
from rlx.rewards.extract import extract_answer, extract_choice

RewardFn = Callable[[str, str, dict[str, Any]], float]
# Factories: extraction mode -> reward function.
REWARDS: Registry[Callable[[str], RewardFn]] = Registry("reward")


@functools.cache
def _gym_scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


@REWARDS.register("reasoning_gym")
def reasoning_gym_reward(extract: str) -> RewardFn:
    """The task's own reasoning-gym scorer, applied to the extracted answer."""

    def score(completion: str, label: str, metadata: dict[str, Any]) -> float:
        task = metadata.get("source_dataset")
        if not task:
            raise KeyError("reasoning_gym reward needs metadata.source_dataset (the reasoning-gym task name)")
        entry = {"answer": label, "metadata": metadata, "question": metadata.get("question", "")}
        return float(_gym_scorer(task)(extract_answer(completion, extract), entry))

    return score


@REWARDS.register("exact_match")
def exact_match_reward(extract: str) -> RewardFn:
    def score(completion: str, label: str, metadata: dict[str, Any]) -> float:
        answer = extract_answer(completion, extract)
        return float(answer is not None and answer.strip() == str(label).strip())

    return score


@REWARDS.register("math_verify")
def math_verify_reward(extract: str) -> RewardFn:
    """Mathematical equivalence via `math-verify` (LaTeX and plain expressions).

    math-verify's own timeouts use SIGALRM, which only the main thread may set, and rlx scores off
    it; so they are off, and `reward.timeout_s` bounds the call instead (it runs in the reward pool).
    """
    from math_verify import parse, verify

    def read(text: str) -> list:
        return parse(f"${text}$", parsing_timeout=None) or parse(text, parsing_timeout=None)

    def score(completion: str, label: str, metadata: dict[str, Any]) -> float:
        answer = extract_answer(completion, extract)
        if answer is None:
            return 0.0
        gold, guess = read(str(label)), read(answer)
        return float(bool(gold) and bool(guess) and verify(gold, guess, timeout_seconds=None))

    return score


@REWARDS.register("multiple_choice")
def multiple_choice_reward(extract: str) -> RewardFn:
    """1 if the chosen option letter equals the label's (`B`, `(B)` or `B) text` all name B)."""

    def score(completion: str, label: str, metadata: dict[str, Any]) -> float:
        scoped = extract_answer(completion, extract) if extract in ("answer_tag", "boxed") else completion
        choice, gold = extract_choice(scoped or ""), extract_choice(str(label))
        if gold is None:
            raise ValueError(f"label {label!r} names no option letter (A-J)")
        return float(choice == gold)

    return score


DEFAULT_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"


@REWARDS.register("format")
def format_reward(extract: str, pattern: str = DEFAULT_FORMAT) -> RewardFn:
    """1 if the whole completion matches `reward.format_pattern` (default: <think>..</think><answer>..</answer>)."""
    compiled = re.compile(pattern, re.DOTALL)

    def score(completion: str, label: str, metadata: dict[str, Any]) -> float:
        return float(compiled.fullmatch(completion.strip()) is not None)

    return score


@REWARDS.register("environment")
def environment_reward(extract: str) -> RewardFn:
    """The reward a multi-turn environment gave at the end of its episode (`rollout.agent`)."""

    def score(completion: str, label: str, metadata: dict[str, Any]) -> float:
        if "env_error" in metadata:
            raise RuntimeError(f"the episode failed: {metadata['env_error']}")
        if "env_reward" not in metadata:
            raise KeyError("reward.name=environment: this trajectory's environment gave no reward; use an "
                           "environment that returns one at the end (EnvStep.reward), or another reward.name")
        return float(metadata["env_reward"])

    return score
