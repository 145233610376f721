"""Judge output parsers for GenRM: the judge's text -> a score in [0, 1] (or ValueError).

The judge reads the policy's response and may quote it, and the policy learns whatever raises its
score, so a parser takes only a verdict the judge's text states without contradiction: quoted spans
("...", “...”, `...`) are dropped first, and a text whose verdicts disagree (a yes and a no, two
different scores) or whose score is out of range is unparseable, which fails its sample rather
than rewarding it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from rlx.registry import Registry

JudgeParser = Callable[[str, float], float]  # (judge text, max_score) -> score in [0, 1]
JUDGE_PARSERS: Registry[JudgeParser] = Registry("judge parser")
_QUOTED = re.compile(r'"[^"]*"|“[^”]*”|`[^`]*`')
_WORD = re.compile(r"[a-z]+(?:['’]t)?")
_YES, _NO = frozenset({"yes", "correct", "true", "right"}), frozenset({"no", "incorrect", "wrong", "false"})
_NUMBER = r"(-?\d+(?:\.\d+)?)"
_LABELLED = re.compile(r"\b(?:score|rating|grade)\s*(?:is|of|=|:)?\s*" + _NUMBER, re.IGNORECASE)
_ONLY_NUMBER = re.compile(_NUMBER + r"(?:\s*/\s*\d+(?:\.\d+)?)?\.?")


def _unquoted(text: str) -> str:
    return _QUOTED.sub(" ", text)


def _negates(word: str) -> bool:
    return word in ("not", "never") or word.endswith(("n't", "n’t"))


@JUDGE_PARSERS.register("yes_no")
def parse_yes_no(text: str, max_score: float) -> float:
    """The verdict the reply opens with ("No. It would be correct if..." is no), else 1 if every
    yes/no word outside quotes says yes and 0 if every one says no; a negation right before a word
    turns it ("not correct", "isn't right" are no). Mixed verdicts are unparseable."""
    words = _WORD.findall(_unquoted(text).lower())
    if words and (words[0] in _YES or words[0] in _NO):
        return float(words[0] in _YES)
    verdicts = {(word in _YES) != (index > 0 and _negates(words[index - 1]))
                for index, word in enumerate(words) if word in _YES or word in _NO}
    if len(verdicts) != 1:
        said = "both yes and no" if verdicts else "neither yes nor no"
        raise ValueError(f"judge said {said}: {text[:80]!r}")
    return float(verdicts.pop())


@JUDGE_PARSERS.register("score")
def parse_score(text: str, max_score: float) -> float:
    """The labelled score outside quotes ("Score: 7", "rating 7/10"), or the reply if it is only a
    number, divided by `max_score`. Two different labelled scores, or one outside [0, max_score],
    are unparseable."""
    unquoted = _unquoted(text)
    labelled = {float(value) for value in _LABELLED.findall(unquoted)}
    only = _ONLY_NUMBER.fullmatch(unquoted.strip())
    if len(labelled) > 1:
        raise ValueError(f"judge gave different scores {sorted(labelled)}: {text[:80]!r}")
    if labelled:
        value = labelled.pop()
    elif only:
        value = float(only.group(1))
    else:
        raise ValueError(f"judge gave no 'Score: N' verdict: {text[:80]!r}")
    if not 0.0 <= value <= max_score:
        raise ValueError(f"judge's score {value:g} is outside [0, {max_score:g}]: {text[:80]!r}")
    return value / max_score
