"""Advantage estimators: rewards of a group of responses to one prompt -> per-response advantages."""

from __future__ import annotations

import torch

from rlx.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


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
def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, norm_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean(group)) / (std(group) + eps); Dr.GRPO-style without the std division."""
    mean, std = group_stats(rewards.float(), group_ids)
    advantages = rewards - mean
    return advantages / (std + eps) if norm_std else advantages


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm_std: bool = False) -> torch.Tensor:
    """RLOO: A_i = r_i - mean of the *other* responses in the group = n/(n-1) (r_i - mean).
    `norm_std` is ignored. A group of one gets 0."""
    mean, _ = group_stats(rewards.float(), group_ids)
    _, index = torch.unique(group_ids, return_inverse=True)
    count = torch.bincount(index).to(rewards.dtype)[index]
    return torch.where(count > 1, (rewards - mean) * count / (count - 1).clamp(min=1), torch.zeros_like(mean))


def _batch_normalize(values: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    if values.numel() < 2:
        return values - values.mean()
    return (values - values.mean()) / (values.std() + eps)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm_std: bool = True) -> torch.Tensor:
    """REINFORCE++: rewards normalised over the whole batch (no per-prompt baseline)."""
    return _batch_normalize(rewards.float())


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(rewards: torch.Tensor, group_ids: torch.Tensor,
                                     norm_std: bool = True) -> torch.Tensor:
    """REINFORCE++ with a group baseline: subtract the group mean, then normalise over the batch."""
    mean, _ = group_stats(rewards.float(), group_ids)
    return _batch_normalize(rewards - mean)
