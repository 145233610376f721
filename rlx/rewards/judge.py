"""Judge output parsers for GenRM: the judge's text -> a score in [0, 1] (or ValueError).

The judge reads the policy's response and may quote it, so a parser takes the judge's own verdict:
`yes_no` the first yes/no word with its negation ("not correct" is no), `score` the last labelled
score ("Score: 7"), never any number the text happens to hold.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from rlx.registry import Registry

JudgeParser = Callable[[str, float], float]  # (judge text, max_score) -> score in [0, 1]
JUDGE_PARSERS: Registry[JudgeParser] = Registry("judge parser")
_WORD = re.compile(r"[a-z]+(?:['’]t)?")
_YES, _NO = frozenset({"yes", "correct", "true", "right"}), frozenset({"no", "incorrect", "wrong", "false"})
_NUMBER = r"(-?\d+(?:\.\d+)?)"
_LABELLED = re.compile(r"\b(?:score|rating|grade)\s*(?:is|of|=|:)?\s*" + _NUMBER, re.IGNORECASE)
_ONLY_NUMBER = re.compile(_NUMBER + r"(?:\s*/\s*\d+(?:\.\d+)?)?\.?")


def _negates(word: str) -> bool:
    return word in ("not", "never") or word.endswith(("n't", "n’t"))


@JUDGE_PARSERS.register("yes_no")
def parse_yes_no(text: str, max_score: float) -> float:
    """1 if the first yes/no word says yes, 0 if it says no; a negation right before it turns it
    ("not correct", "isn't right" are no)."""
    words = _WORD.findall(text.lower())
    for index, word in enumerate(words):
        if word in _YES or word in _NO:
            negated = index > 0 and _negates(words[index - 1])
            return float((word in _YES) != negated)
    raise ValueError(f"judge said neither yes nor no: {text[:80]!r}")


@JUDGE_PARSERS.register("score")
def parse_score(text: str, max_score: float) -> float:
    """The last labelled score ("Score: 7", "rating 7/10"), or the reply if it is only a number,
    divided by `max_score` and clipped to [0, 1]."""
    labelled = _LABELLED.findall(text)
    only = _ONLY_NUMBER.fullmatch(text.strip())
    if labelled:
        value = labelled[-1]
    elif only:
        value = only.group(1)
    else:
        raise ValueError(f"judge gave no 'Score: N' verdict: {text[:80]!r}")
    return min(1.0, max(0.0, float(value) / max_score))
