"""Judge output parsers for GenRM: the judge's text -> a score in [0, 1] (or ValueError)."""

from __future__ import annotations

import re
from collections.abc import Callable

from rlx.registry import Registry

JudgeParser = Callable[[str, float], float]  # (judge text, max_score) -> score in [0, 1]
JUDGE_PARSERS: Registry[JudgeParser] = Registry("judge parser")
_WORD = re.compile(r"[a-z]+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@JUDGE_PARSERS.register("yes_no")
def parse_yes_no(text: str, max_score: float) -> float:
    """1 if the first yes/no word is yes, 0 if it is no."""
    for word in _WORD.findall(text.lower()):
        if word in ("yes", "correct", "true"):
            return 1.0
        if word in ("no", "incorrect", "wrong", "false"):
            return 0.0
    raise ValueError(f"judge said neither yes nor no: {text[:80]!r}")


@JUDGE_PARSERS.register("score")
def parse_score(text: str, max_score: float) -> float:
    """The first number in the text, divided by `max_score` and clipped to [0, 1]."""
    match = _NUMBER.search(text)
    if match is None:
        raise ValueError(f"judge gave no number: {text[:80]!r}")
    return min(1.0, max(0.0, float(match.group()) / max_score))
