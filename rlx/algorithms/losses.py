"""Policy losses: per-token loss terms, to be aggregated by `aggregate`."""

from __future__ import annotations

import torch

from rlx.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")


@POLICY_LOSSES.register("clipped")
def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO/GRPO clipped surrogate with separate bounds (DAPO clip-higher).

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), r_t = exp(logp_t - old_logp_t).
    Returns (per-token loss, per-token 1.0 where the clipped branch was taken).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).float()
