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
