"""Advantages: per-group advantage estimation; marks samples that cannot teach anything."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from rlx.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlx.config import AlgorithmConfig
from rlx.data.sample import Sample


@dataclass
class AdvantageResult:
    kept: list[Sample]
    filtered: Counter = field(default_factory=Counter)  # reason -> number of samples


class Advantages:
    def __init__(self, config: AlgorithmConfig) -> None:
        self.config = config
        self.estimator = ADVANTAGE_ESTIMATORS.get(config.advantage)

    def compute(self, samples: list[Sample]) -> AdvantageResult:
        """Set `advantage` on every scored sample and `filter_reason` on those not to train on.

        `samples` must hold whole groups: group statistics are taken over what is passed in.
        """
        for sample in samples:
            if sample.reward_error is not None:
                sample.filter_reason, sample.advantage = "reward_failed", 0.0
        scored = [s for s in samples if s.filter_reason is None]
        if scored:
            rewards = torch.tensor([s.reward for s in scored], dtype=torch.float32)
            group_ids = torch.tensor([s.group_id for s in scored])
            advantages = self.estimator(rewards, group_ids, norm_std=self.config.norm_std)
            for sample, advantage in zip(scored, advantages.tolist()):
                sample.advantage = advantage
            if self.config.filter_zero_std_groups:
                rewards_of: dict[int, set[float]] = {}
                for sample in scored:
                    rewards_of.setdefault(sample.group_id, set()).add(sample.reward)
                for sample in scored:
                    if len(rewards_of[sample.group_id]) == 1:
                        sample.filter_reason = "zero_std_group"
        return AdvantageResult(
            kept=[s for s in samples if s.filter_reason is None],
            filtered=Counter(s.filter_reason for s in samples if s.filter_reason is not None),
        )
