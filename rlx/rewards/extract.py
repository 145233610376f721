"""Pull the final answer out of a completion before it is compared with the label."""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def extract_answer(text: str, mode: str) -> str | None:
    """`last_number`, `answer_tag` (<answer>..</answer>), `boxed` (\\boxed{..}) or `none` (whole text)."""
    if mode == "none":
        return text.strip()
    if mode == "last_number":
        numbers = NUMBER.findall(text.replace(",", ""))
        return numbers[-1] if numbers else None
    if mode == "answer_tag":
        matches = ANSWER_TAG.findall(text)
        return matches[-1] if matches else None
    if mode == "boxed":
        return last_boxed(text)
    raise ValueError(f"reward.extract={mode!r} is unknown; use last_number, answer_tag, boxed or none")


_CHOICE_PATTERNS = [
    re.compile(r"(?i:answer)\s*(?:is|:)?\s*\(?([A-J])\)?(?![A-Za-z])"),  # "the answer is (B)", "Answer: C"
    re.compile(r"^\s*\(?([A-J])(?:\)|\.|:|\s*$)"),  # "B", "(B)", "B) text", "C. text"
]
_LAST_LETTER = re.compile(r"(?<![A-Za-z])\(?([A-J])\)?(?![A-Za-z])")


def extract_choice(text: str) -> str | None:
    """The option letter a text picks: after "answer", at its start, else its last standalone A-J."""
    for pattern in _CHOICE_PATTERNS:
        match = pattern.search(text)
        if match:
            return match.group(1).upper()
    letters = _LAST_LETTER.findall(text)
    return letters[-1].upper() if letters else None
