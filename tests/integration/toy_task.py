"""A toy task a random tiny model can learn in seconds: answer with as many 'a's as possible."""

import time
import zlib


def count_a(completion: str, label: str, metadata: dict) -> float:
    """Share of characters in the completion equal to the label character."""
    return completion.count(label) / max(1, len(completion))


def paced_count_a(completion: str, label: str, metadata: dict) -> float:
    """`count_a`, a second later: paces a toy run to about 2 s a step, so the driver (which polls
    every 2 s) sees each step while it happens and can inject a fault at a given step."""
    time.sleep(1.0)
    return count_a(completion, label, metadata)


def varied_on_even_prompts(completion: str, label: str, metadata: dict) -> float:
    """A score that differs between distinct completions on even-numbered prompts, and 0 for every
    response to an odd one (a zero-variance group, which dynamic sampling must drop and replace)."""
    return (zlib.crc32(completion.encode()) % 1000) / 1000 if metadata["index"] % 2 == 0 else 0.0


def misbehaving_count_a(completion: str, label: str, metadata: dict) -> float:
    """`count_a` on a quarter of the prompts; on the rest it raises, returns garbage or hangs."""
    kind = metadata["index"] % 4
    if kind == 1:
        raise ValueError("reward server said no")
    if kind == 2:
        return float("nan") if zlib.crc32(completion.encode()) % 2 else "not a number"
    if kind == 3:
        time.sleep(3)  # longer than the test's reward.timeout_s
    return count_a(completion, label, metadata)


def judge_length(text: str, max_score: float) -> float:
    """A judge parser for a tiny random judge: the verdict's length over `max_score` characters."""
    return min(1.0, len(text) / max_score)
