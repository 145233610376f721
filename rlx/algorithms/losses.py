"""Policy losses: per-token loss terms (aggregated later by `aggregate`), each registered by name.

Every registered loss has one signature, `(logprobs, old_logprobs, advantages, mask, config) ->
(per-token loss, per-token 1.0 where the update was cut off)`, so the objective can swap them.
All inputs are [B, R]; `advantages` is already broadcast to tokens.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlx.config import AlgorithmConfig
from rlx.registry import Registry

PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AlgorithmConfig],
                      tuple[torch.Tensor, torch.Tensor]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO/GRPO clipped surrogate with separate bounds (DAPO clip-higher) and optional dual clip.

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), r_t = exp(logp_t - old_logp_t).
    Dual clip (A_t < 0 only): loss_t = min(loss_t, -dual_clip * A_t), bounding how hard one very
    unlikely-now token can push. Returns (per-token loss, 1.0 where a clip was active).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped.float()


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] mean over response tokens of log(pi / pi_old): the log of GSPO's length-normalised ratio."""
    return ((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def gspo_loss(logprobs, old_logprobs, advantages, mask, clip_low: float, clip_high: float):
    """GSPO: one importance ratio per sequence, s_i = exp(mean_t log r_it), clipped like PPO.

    The sequence loss -min(s_i A_i, clip(s_i) A_i) is placed on every token of the sequence;
    aggregate with seq-mean-token-mean for the paper's sequence average.
    """
    seq_ratio = torch.exp(sequence_log_ratio(logprobs, old_logprobs, mask))[:, None]
    advantage = advantages[:, :1]  # GSPO advantages are per sequence
    unclipped = seq_ratio * advantage
    clipped = torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high) * advantage
    loss = -torch.minimum(unclipped, clipped)
    return loss.expand_as(logprobs), (clipped < unclipped).float().expand_as(logprobs)


def sapo_loss(logprobs, old_logprobs, advantages, tau_pos: float, tau_neg: float):
    """SAPO: a smooth gate instead of a hard clip. loss_t = -f(r_t) A_t, f(r) = (4/tau) sigmoid(tau (r - 1)).

    f'(1) = 1, so on-policy tokens get the plain policy gradient; the gradient fades smoothly as the
    ratio drifts, faster for negative advantages when tau_neg > tau_pos. The "cut off" indicator
    marks tokens whose gate weight f'(r) fell below one half.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * gate * advantages
    weight = 4.0 * gate * (1.0 - gate)
    return loss, (weight.detach() < 0.5).float()


def cispo_loss(logprobs, old_logprobs, advantages, clip_low: float, clip_high: float):
    """CISPO: loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t log pi(y_t).

    The importance weight is clipped and detached, so every token keeps a gradient (none is dropped
    as in PPO's clip); only its weight is bounded.
    """
    ratio = torch.exp(logprobs - old_logprobs).detach()
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logprobs, (weight != ratio).float()


POLICY_LOSSES.register("clipped")(
    lambda lp, old, adv, mask, cfg: clipped_policy_loss(lp, old, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip))
POLICY_LOSSES.register("gspo")(
    lambda lp, old, adv, mask, cfg: gspo_loss(lp, old, adv, mask, cfg.gspo_clip_low, cfg.gspo_clip_high))
POLICY_LOSSES.register("sapo")(
    lambda lp, old, adv, mask, cfg: sapo_loss(lp, old, adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg))
POLICY_LOSSES.register("cispo")(
    lambda lp, old, adv, mask, cfg: cispo_loss(lp, old, adv, cfg.cispo_clip_low, cfg.cispo_clip_high))
