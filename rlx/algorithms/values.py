"""Value-based pieces for PPO with a critic: GAE advantages/returns and the clipped value loss."""

from __future__ import annotations

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens ([B, T] each; mask 0 past the end).

    delta_t = r_t + gamma V_{t+1} - V_t (V past the end is 0); A_t = delta_t + gamma lam A_{t+1}.
    Returns (advantages, returns = advantages + values), both zero where mask is 0.
    """
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        current = (delta + gamma * lam * next_advantage) * mask[:, t]
        advantages[:, t] = current
        next_value = values[:, t] * mask[:, t]
        next_advantage = current
    return advantages, (advantages + values) * mask


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float = 0.2) -> torch.Tensor:
    """Per-token 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), as in PPO."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the entries where mask is 1 (population std); 0 elsewhere."""
    count = mask.sum().clamp(min=1.0)
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / count
    return (values - mean) * torch.rsqrt(var + eps) * mask
