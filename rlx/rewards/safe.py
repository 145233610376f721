"""Scoring that never kills a run: a reward that raises or returns garbage fails only its sample."""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any

from rlx.rewards.builtin import RewardFn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardOutcome:
    score: float
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


def score_safely(fn: RewardFn, completion: str, label: str, metadata: dict[str, Any]) -> RewardOutcome:
    try:
        value = fn(completion, label, metadata)
    except Exception as exc:  # a user reward may raise anything; the sample fails, the run goes on
        log.warning("reward function raised %s: %s", type(exc).__name__, exc)
        return RewardOutcome(0.0, f"{type(exc).__name__}: {exc}")
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        log.warning("reward function returned %r; expected a finite number", value)
        return RewardOutcome(0.0, f"bad reward value {value!r}: expected a finite number")
    return RewardOutcome(float(value))
