"""Advantages: per-group (or, with a critic, per-token) advantages; marks samples that cannot teach.

Three sources, combined as the config asks: a group-relative estimator over rewards (GRPO, RLOO,
REINFORCE++), GAE over the critic's values (PPO), and the teacher's per-token reverse-KL signal
(on-policy distillation), which is added to whichever task advantage is on.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass, field

import torch

from rlx.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlx.algorithms.distill import reverse_kl_advantages
from rlx.algorithms.values import gae, masked_whiten
from rlx.config import AlgorithmConfig
from rlx.data.sample import Sample


@dataclass
class AdvantageResult:
    kept: list[Sample]
    filtered: Counter = field(default_factory=Counter)  # reason -> number of samples
    dropped_groups: int = 0  # groups filtered whole for equal rewards


def pad(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-token lists -> ([B, T] values, [B, T] mask)."""
    width = max(1, max(len(r) for r in rows))
    values, mask = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        values[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        mask[i, : len(row)] = 1.0
    return values, mask


def unpad(tensor: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [row[m > 0].tolist() for row, m in zip(tensor, mask)]


def episodes(samples: list[Sample]) -> tuple[list[int], list[int]]:
    """(each sample's episode, as an index into the second list; the first sample of each episode).
    The samples of one episode (`Sample.episode`, agent apps) share its reward; any other sample is
    an episode of its own."""
    index_of: dict[tuple[int, int], int] = {}
    episode_of, firsts = [], []
    for position, sample in enumerate(samples):
        key = (sample.group_id, sample.episode) if sample.episode is not None else (-1, position)
        if key not in index_of:
            index_of[key] = len(firsts)
            firsts.append(position)
        episode_of.append(index_of[key])
    return episode_of, firsts


class Advantages:
    def __init__(self, config: AlgorithmConfig, filter_zero_std: bool | None = None,
                 distill_coef: float | None = None) -> None:
        """`distill_coef` turns on the teacher's reverse-KL advantage; `filter_zero_std` defaults to the config."""
        self.config = config
        self.filter_zero_std = config.filter_zero_std_groups if filter_zero_std is None else filter_zero_std
        self.distill_coef = distill_coef

    def _task_advantages(self, scored: list[Sample]) -> None:
        a = self.config
        rewards = torch.tensor([s.reward for s in scored], dtype=torch.float32)
        if a.advantage == "gae":
            self._gae(scored, rewards)
            return
        if a.advantage == "none":
            advantages = torch.zeros_like(rewards)
        else:  # over episodes: one that made several samples is one response of its group
            episode_of, firsts = episodes(scored)
            group_ids = torch.tensor([scored[i].group_id for i in firsts])
            tokens = None
            if a.reinforce_pp_normalize == "tokens":  # an episode weighs by the trained tokens of all its samples
                tokens = torch.zeros(len(firsts)).index_add(0, torch.tensor(episode_of), torch.tensor(
                    [float(sum(s.loss_mask)) if s.loss_mask is not None else float(len(s.response_ids))
                     for s in scored]))
            estimator = ADVANTAGE_ESTIMATORS.get(a.advantage)
            accepted = inspect.signature(estimator).parameters  # an estimator of yours may take norm_std only
            options = {k: v for k, v in (("eps", a.std_eps), ("tokens", tokens)) if k in accepted}
            per_episode = estimator(rewards[firsts], group_ids, norm_std=a.norm_std, **options)
            advantages = per_episode[episode_of]
        for sample, advantage in zip(scored, advantages.tolist()):
            sample.advantage = advantage

    def _gae(self, scored: list[Sample], rewards: torch.Tensor) -> None:
        """Per-token GAE over the trained tokens only (`Sample.loss_mask`: an agent sample's tool and
        observation tokens are skipped, as the Critic never trains on their values); the outcome
        reward sits on the last trained token. Masked tokens get advantage and return 0."""
        a = self.config
        values, extent = pad([s.values for s in scored])
        trained, _ = pad([s.loss_mask if s.loss_mask is not None else [1.0] * len(s.values) for s in scored])
        trained = trained * extent
        positions = torch.arange(values.shape[1]).expand_as(values)
        last = torch.where(trained > 0, positions, torch.full_like(positions, -1)).max(1).values
        token_rewards = torch.zeros_like(values)
        rows = torch.nonzero(last >= 0).flatten()
        token_rewards[rows, last[rows]] = rewards[rows]  # outcome reward; a sample with no trained token has none
        advantages, returns = gae(token_rewards, values, trained, a.gamma, a.lam)
        if a.whiten_advantages:
            advantages = masked_whiten(advantages, trained, unbiased=a.whiten_variance == "unbiased")
        for sample, adv, ret, m in zip(scored, unpad(advantages, extent), unpad(returns, extent), trained):
            sample.token_advantages, sample.returns = adv, ret
            sample.advantage = float(sum(adv)) / max(1.0, float(m.sum()))

    def _add_distillation(self, scored: list[Sample]) -> None:
        teacher, mask = pad([s.teacher_logprobs for s in scored])
        student, _ = pad([s.rollout_logprobs for s in scored])
        task, _ = pad([s.token_advantages or [s.advantage] * len(s.response_ids) for s in scored])
        combined = reverse_kl_advantages(student, teacher, task, self.distill_coef) * mask
        for sample, adv in zip(scored, unpad(combined, mask)):
            sample.token_advantages = adv

    def _drop_equal_reward_groups(self, scored: list[Sample]) -> int:
        rewards_of: dict[int, set[float]] = {}
        for sample in scored:
            rewards_of.setdefault(sample.group_id, set()).add(sample.reward)
        dropped = {g for g, rewards in rewards_of.items() if len(rewards) == 1}
        for sample in scored:
            if sample.group_id in dropped:
                sample.filter_reason = "zero_std_group"
        return len(dropped)

    def compute(self, samples: list[Sample]) -> AdvantageResult:
        """Set `advantage` (and `token_advantages`, `returns` where per-token) on every scored sample
        and `filter_reason` on those not to train on.

        `samples` must hold whole groups: group statistics are taken over what is passed in.
        """
        for sample in samples:
            if sample.reward_error is not None:
                sample.filter_reason, sample.advantage = "reward_failed", 0.0
        scored = [s for s in samples if s.filter_reason is None]
        dropped = 0
        if scored:
            self._task_advantages(scored)
            if self.distill_coef is not None:
                self._add_distillation(scored)
            if self.filter_zero_std:
                dropped = self._drop_equal_reward_groups(scored)
        return AdvantageResult(
            kept=[s for s in samples if s.filter_reason is None],
            filtered=Counter(s.filter_reason for s in samples if s.filter_reason is not None),
            dropped_groups=dropped,
        )
