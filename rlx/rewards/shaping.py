"""Reward shaping applied after scoring."""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to `max_length - buffer` tokens, then falling linearly
    to `-penalty` at `max_length`, so truncated answers are discouraged without a cliff."""
    if buffer <= 0:
        return 0.0
    start = max_length - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer)
