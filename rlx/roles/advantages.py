"""Advantages: per-group advantage estimation, dropping samples that cannot teach anything."""

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
        result = AdvantageResult(kept=[])
        scored = []
        for sample in samples:
            if sample.reward_error is not None:
                result.filtered["reward_failed"] += 1
            else:
                scored.append(sample)
        if not scored:
            return result
        rewards = torch.tensor([s.reward for s in scored], dtype=torch.float32)
        group_ids = torch.tensor([s.group_id for s in scored])
        advantages = self.estimator(rewards, group_ids, norm_std=self.config.norm_std)
        for sample, advantage in zip(scored, advantages.tolist()):
            sample.advantage = advantage
        by_group: dict[int, list[Sample]] = {}
        for sample in scored:
            by_group.setdefault(sample.group_id, []).append(sample)
        for members in by_group.values():
            flat = len({s.reward for s in members}) == 1
            if flat and self.config.filter_zero_std_groups:
                result.filtered["zero_std_group"] += len(members)
            else:
                result.kept.extend(members)
        return result
