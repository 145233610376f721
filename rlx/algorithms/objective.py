"""The full policy objective: policy loss + KL to a reference - entropy bonus, aggregated."""

from __future__ import annotations

import torch

from rlx.algorithms.aggregate import aggregate
from rlx.algorithms.kl import kl_estimate
from rlx.algorithms.losses import POLICY_LOSSES
from rlx.config import AlgorithmConfig


def policy_objective(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    fields: dict[str, torch.Tensor],
    config: AlgorithmConfig,
    global_tokens: float,
    global_sequences: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`fields` holds [B, R] `old_logprobs`, `advantages` and, when KL is on, `ref_logprobs`.

    Every metric is this micro-batch's share of the global value (aggregated like the loss; clip
    fraction and ratio per token), so summing over micro-batches gives the step's value.
    """
    loss_fn = POLICY_LOSSES.get(config.policy_loss)
    per_token, clipped = loss_fn(
        logprobs, fields["old_logprobs"], fields["advantages"], clip_low=config.clip_low, clip_high=config.clip_high
    )
    policy_loss = aggregate(per_token, mask, config.aggregation, global_tokens, global_sequences)
    loss = policy_loss
    metrics = {"policy_loss": policy_loss.item()}
    if config.kl_coef > 0:
        kl = aggregate(kl_estimate(logprobs, fields["ref_logprobs"], config.kl_type), mask, config.aggregation,
                       global_tokens, global_sequences)
        loss = loss + config.kl_coef * kl
        metrics["kl"] = kl.item()
    entropy_mean = aggregate(entropy, mask, config.aggregation, global_tokens, global_sequences)
    if config.entropy_coef > 0:
        loss = loss - config.entropy_coef * entropy_mean
    token_share = lambda values: float((values * mask).sum()) / max(global_tokens, 1.0)  # noqa: E731
    metrics.update(
        entropy=entropy_mean.item(),
        clip_fraction=token_share(clipped),
        ratio_mean=token_share(torch.exp(logprobs - fields["old_logprobs"]).detach()),
        loss=loss.item(),
    )
    return loss, metrics


TOKEN_SHARE_METRICS = ("clip_fraction", "ratio_mean")


def loss_scale(aggregation: str, tokens: float, sequences: float) -> float:
    """The factor that turns summed (normaliser 1) losses into the aggregated mean."""
    return 1.0 / max(tokens if aggregation == "token-mean" else sequences, 1.0)


def finalize_metrics(sums: dict[str, float], aggregation: str, tokens: float, sequences: float) -> dict[str, float]:
    """Metric sums from `policy_objective(..., 1, 1)` over a step -> the step's means."""
    scale = loss_scale(aggregation, tokens, sequences)
    return {k: v / max(tokens, 1.0) if k in TOKEN_SHARE_METRICS else v * scale for k, v in sums.items()}
