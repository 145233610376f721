"""Pure tensor math for RL: advantage estimators, policy losses, KL estimators, aggregation."""

from rlx.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlx.algorithms.aggregate import aggregate
from rlx.algorithms.kl import kl_estimate
from rlx.algorithms.losses import (
    POLICY_LOSSES,
    LossInputs,
    LossTerms,
    cispo_loss,
    clipped_policy_loss,
    gspo_loss,
    sapo_loss,
)
from rlx.algorithms.objective import finalize_metrics, loss_scale, policy_objective

__all__ = [
    "ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "LossInputs", "LossTerms", "aggregate", "cispo_loss",
    "clipped_policy_loss", "finalize_metrics", "grpo_advantages", "gspo_loss", "kl_estimate", "loss_scale",
    "policy_objective", "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "rloo_advantages", "sapo_loss",
]
