"""Pure tensor math for RL: advantage estimators, policy losses, KL estimators, aggregation."""

from rlx.algorithms.advantages import ADVANTAGE_ESTIMATORS, grpo_advantages
from rlx.algorithms.aggregate import aggregate
from rlx.algorithms.kl import kl_estimate
from rlx.algorithms.losses import POLICY_LOSSES, clipped_policy_loss
from rlx.algorithms.objective import finalize_metrics, loss_scale, policy_objective

__all__ = [
    "ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "aggregate", "clipped_policy_loss", "grpo_advantages",
    "finalize_metrics", "kl_estimate", "loss_scale", "policy_objective",
]
