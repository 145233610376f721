"""Reward: scores each sample (or each group); a failing reward function fails only its samples."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

from rlx.data.sample import Sample
from rlx.rewards import RewardOutcome, score_group_safely, score_safely
from rlx.rewards.shaping import overlong_penalty


class Reward:
    def __init__(self, reward_fn: Callable[..., Any], max_length: int = 0, overlong_buffer: int = 0,
                 overlong_factor: float = 1.0, scope: str = "sample", timeout_s: float | None = None) -> None:
        self.reward_fn, self.scope, self.timeout_s = reward_fn, scope, timeout_s
        self.max_length, self.overlong_buffer, self.overlong_factor = max_length, overlong_buffer, overlong_factor

    def _outcomes(self, samples: list[Sample]) -> list[RewardOutcome]:
        if self.scope == "sample":
            return [score_safely(self.reward_fn, s.response_text, s.label, s.metadata, self.timeout_s)
                    for s in samples]
        groups: dict[int, list[int]] = defaultdict(list)
        for i, sample in enumerate(samples):
            groups[sample.group_id].append(i)
        outcomes: list[RewardOutcome] = [RewardOutcome(0.0)] * len(samples)
        for members in groups.values():
            first = samples[members[0]]
            scored = score_group_safely(self.reward_fn, [samples[i].response_text for i in members], first.label,
                                        first.metadata, self.timeout_s)
            for i, outcome in zip(members, scored):
                outcomes[i] = outcome
        return outcomes

    def score(self, samples: list[Sample]) -> list[Sample]:
        """Set `reward` (or `reward_error`) on every sample; group scope needs whole groups."""
        for sample, outcome in zip(samples, self._outcomes(samples)):
            sample.reward, sample.reward_error = outcome.score, outcome.error
            if not outcome.failed and self.overlong_buffer:
                sample.reward += overlong_penalty(len(sample.response_ids), self.max_length, self.overlong_buffer,
                                                  self.overlong_factor)
        return samples
