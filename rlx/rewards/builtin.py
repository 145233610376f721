"""Built-in rule rewards. Every reward maps (completion, label, metadata) -> score in [0, 1]."""

from __future__ import annotations

import ast
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

from rlx.registry import Registry
from rlx.rewards.extract import extract_answer, extract_choice

RewardFn = Callable[[str, str, dict[str, Any]], float]
# Factories: extraction mode -> reward function.
REWARDS: Registry[Callable[[str], RewardFn]] = Registry("reward")


# reasoning-gym scorers that run the answer as Python (review N1). Confining the pool process keeps
# such code off the host, but not off the reward: inside the worker it could rewrite its own score,
# or the scorers of every later sample. So the answer never reaches them as code:
# - these sympy-parse it: an answer outside a math grammar is scored as no answer (None);
_ARITHMETIC = re.compile(r"[0-9\s+\-*/().]*")
_SYMBOLIC_CHARS = re.compile(r"[A-Za-z0-9\s+\-*/^().,]*")
_SYMBOLIC_NAMES = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh",
                             "tanh", "exp", "log", "ln", "sqrt", "pi", "Abs", "oo"})
_PARSED_TASKS = {"countdown": "arithmetic", "puzzle24": "arithmetic", "polynomial_multiplication": "symbolic",
                 "simple_integration": "symbolic", "intermediate_integration": "symbolic"}
# - these `eval` it (or the label): their module's `eval` reads Python literals only.
_LITERAL_TASKS = frozenset({"n_queens", "binary_matrix", "spiral_matrix", "string_insertion", "number_sorting"})
EVALUATING_TASKS = frozenset(_PARSED_TASKS) | _LITERAL_TASKS


def _safe_to_parse(answer: str, grammar: str) -> bool:
    """Digits and operators (arithmetic), plus one-letter variables and sympy's elementary functions
    (symbolic): no strings, underscores or attribute access, so nothing but math can be named."""
    if grammar == "arithmetic":
        return _ARITHMETIC.fullmatch(answer) is not None
    names = set(re.findall(r"[A-Za-z]+", answer))
    return (_SYMBOLIC_CHARS.fullmatch(answer) is not None and re.search(r"\.\s*[A-Za-z]", answer) is None
            and all(len(n) == 1 or n in _SYMBOLIC_NAMES for n in names))


def _literal_eval(text: str, *_: Any) -> Any:
    """`eval` for the scorers that only mean to read a Python literal (a list, a matrix)."""
    return ast.literal_eval(text)


@functools.cache
def _gym_scorer(task: str):
    import reasoning_gym

    scorer = reasoning_gym.get_score_answer_fn(task)
    if task in _LITERAL_TASKS:
        inspect.getmodule(scorer).eval = _literal_eval  # shadows the builtin for that module's code only
    return scorer


@REWARDS.register("reasoning_gym")
def reasoning_gym_reward(extract: str) -> RewardFn:
    """The task's own reasoning-gym scorer, applied to the extracted answer; an answer one of the
    evaluating scorers would run as code is scored as no answer (see EVALUATING_TASKS)."""

    def score(completion: str, label: str, metadata: dict[str, Any]) -> float:
        task = metadata.get("source_dataset")
        if not task:
            raise KeyError("reasoning_gym reward needs metadata.source_dataset (the reasoning-gym task name)")
        entry = {"answer": label, "metadata": metadata, "question": metadata.get("question", "")}
        answer = extract_answer(completion, extract)
        if answer is not None and task in _PARSED_TASKS and not _safe_to_parse(answer, _PARSED_TASKS[task]):
            answer = None
        return float(_gym_scorer(task)(answer, entry))

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
