"""Learning-rate multipliers: linear warm-up, then constant, cosine or linear decay to zero."""

from __future__ import annotations

import math


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"train.lr_schedule={schedule!r} is unknown; use constant, cosine or linear")
