"""Reward: scores each sample; a failing reward function fails only that sample."""

from __future__ import annotations

from rlx.data.sample import Sample
from rlx.rewards import RewardFn, score_safely
from rlx.rewards.shaping import overlong_penalty


class Reward:
    def __init__(self, reward_fn: RewardFn, max_length: int = 0, overlong_buffer: int = 0,
                 overlong_factor: float = 1.0) -> None:
        self.reward_fn = reward_fn
        self.max_length, self.overlong_buffer, self.overlong_factor = max_length, overlong_buffer, overlong_factor

    def score(self, samples: list[Sample]) -> list[Sample]:
        for sample in samples:
            outcome = score_safely(self.reward_fn, sample.response_text, sample.label, sample.metadata)
            sample.reward, sample.reward_error = outcome.score, outcome.error
            if not outcome.failed and self.overlong_buffer:
                sample.reward += overlong_penalty(len(sample.response_ids), self.max_length, self.overlong_buffer,
                                                  self.overlong_factor)
        return samples
