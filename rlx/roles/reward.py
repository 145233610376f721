"""Reward: scores each sample; a failing reward function fails only that sample."""

from __future__ import annotations

from rlx.data.sample import Sample
from rlx.rewards import RewardFn, score_safely


class Reward:
    def __init__(self, reward_fn: RewardFn) -> None:
        self.reward_fn = reward_fn

    def score(self, samples: list[Sample]) -> list[Sample]:
        for sample in samples:
            outcome = score_safely(self.reward_fn, sample.response_text, sample.label, sample.metadata)
            sample.reward, sample.reward_error = outcome.score, outcome.error
        return samples
