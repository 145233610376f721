"""Value-based pieces for PPO with a critic: GAE advantages/returns and the clipped value loss."""

from __future__ import annotations

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the trained tokens ([B, T] each; mask 0 on tokens the
    policy did not generate, such as a multi-turn sample's observation tokens, and past the end).

    delta_t = r_t + gamma V_next - V_t; A_t = delta_t + gamma lam A_next, where "next" is the next
    trained token (V past the last one is 0). Masked tokens are skipped: their values (which the
    Critic never trains on) and rewards do not enter, they do not count as a discount step, and the
    next value and advantage carry across them (as verl's compute_gae_advantage_return).
    Returns (advantages, returns = advantages + values), both zero where mask is 0.
    """
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        trained = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        current = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(trained, current, torch.zeros_like(current))
        next_value = torch.where(trained, values[:, t], next_value)
        next_advantage = torch.where(trained, current, next_advantage)
    return advantages, (advantages + values) * mask


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float = 0.2) -> torch.Tensor:
    """Per-token 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), as in PPO."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, unbiased: bool = True) -> torch.Tensor:
    """(x - mean) * rsqrt(var + eps) over the entries where mask is 1; 0 elsewhere.

    `unbiased`: Bessel's correction, var = sum (x - mean)^2 / (N - 1), as verl's masked_whiten
    (a single entry then gets var 0); False: the population variance, divided by N."""
    count = mask.sum().clamp(min=1.0)
    mean = (values * mask).sum() / count
    squares = (((values - mean) * mask) ** 2).sum()
    var = squares / (count - 1.0).clamp(min=1.0) if unbiased else squares / count
    return (values - mean) * torch.rsqrt(var + eps) * mask
