"""Advantage estimators: rewards of a group of responses to one prompt -> per-response advantages.

Every estimator takes `(rewards, group_ids, norm_std=True, eps=1e-6, tokens=None)`: `eps` is added
to the std (outside the square root), `tokens` holds each response's trained-token count for the
estimators that can weight by it (REINFORCE++ normalised over tokens). Group statistics are taken
in the rewards' floating dtype (float32 for integer rewards).
"""

from __future__ import annotations

import torch

from rlx.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


def _floating(values: torch.Tensor) -> torch.Tensor:
    return values if values.is_floating_point() else values.float()


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element mean and unbiased std of the element's group (std 0 for a group of one)."""
    groups, index = torch.unique(group_ids, return_inverse=True)
    zeros = values.new_zeros(len(groups))
    count = zeros.index_add(0, index, torch.ones_like(values))
    mean = zeros.index_add(0, index, values) / count
    sq_dev = zeros.index_add(0, index, (values - mean[index]) ** 2)
    std = torch.where(count > 1, sq_dev / (count - 1).clamp(min=1), torch.zeros_like(sq_dev)).sqrt()
    return mean[index], std[index]


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm_std: bool = True, eps: float = 1e-6,
                    tokens: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean(group)) / (std(group) + eps); Dr.GRPO-style without the std division."""
    rewards = _floating(rewards)
    mean, std = group_stats(rewards, group_ids)
    advantages = rewards - mean
    return advantages / (std + eps) if norm_std else advantages


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm_std: bool = False, eps: float = 1e-6,
                    tokens: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO: A_i = r_i - mean of the *other* responses in the group = n/(n-1) (r_i - mean).
    `norm_std` and `eps` are ignored. A group of one gets 0."""
    rewards = _floating(rewards)
    mean, _ = group_stats(rewards, group_ids)
    _, index = torch.unique(group_ids, return_inverse=True)
    count = torch.bincount(index).to(rewards.dtype)[index]
    return torch.where(count > 1, (rewards - mean) * count / (count - 1).clamp(min=1), torch.zeros_like(mean))


def _batch_normalize(values: torch.Tensor, eps: float, tokens: torch.Tensor | None) -> torch.Tensor:
    """Over responses: (x - mean) / (std + eps), Bessel over responses. Over tokens (`tokens` given):
    each response counts once per trained token, (x - mean) * rsqrt(var + 1e-8) with Bessel over
    tokens, which is whitening the per-token advantages (verl's masked_whiten)."""
    if tokens is not None:
        weights = tokens.to(values.dtype)
        total = weights.sum()
        mean = (weights * values).sum() / total.clamp(min=1.0)
        var = (weights * (values - mean) ** 2).sum() / (total - 1.0).clamp(min=1.0)
        return (values - mean) * torch.rsqrt(var + 1e-8)
    if values.numel() < 2:
        return values - values.mean()
    return (values - values.mean()) / (values.std() + eps)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm_std: bool = True,
                            eps: float = 1e-6, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++: rewards normalised over the whole batch (no per-prompt baseline)."""
    return _batch_normalize(_floating(rewards), eps, tokens)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm_std: bool = True,
                                     eps: float = 1e-6, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ with a group baseline: subtract the group mean, then normalise over the batch."""
    rewards = _floating(rewards)
    mean, _ = group_stats(rewards, group_ids)
    return _batch_normalize(rewards - mean, eps, tokens)
