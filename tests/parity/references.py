"""The references the parity cases compare rlx against.

TRL 1.16 is called as a library: `GRPOTrainer._compute_loss` runs on a minimal stand-in object
that holds exactly the attributes the method reads. Its one model call goes through
`_get_per_token_logps_and_entropies`; the stand-in's version of that helper returns the case's
log-probs and entropies (leaf tensors, so the gradients w.r.t. them are taken), which is the only
part of TRL replaced. Nothing else of TRL is re-implemented, except where noted (the advantage
normalisation and the vLLM importance-sampling ratio live inside `_generate_and_score_completions`,
which needs a model and a generation backend: their formulas are written below from that method,
using TRL's own `nanstd`).

verl's functions are NOT imported or copied: each formula below is written from its definition in
verl `volcengine/verl` @ b178a3cd56f58b2d502255daba591e92833930a7 (the commit the `fetch` tool
returned, 2026-01-29), files verl/trainer/ppo/core_algos.py, verl/utils/torch_functional.py and
verl/trainer/ppo/rollout_corr_helper.py; the comment on each names the verl function it stands for.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from types import SimpleNamespace

import torch

with warnings.catch_warnings():  # TRL warns about the installed vLLM version on import
    warnings.simplefilter("ignore")
    from trl import GRPOTrainer
    from trl.trainer.utils import nanstd

# ------------------------------------------------------------------------------------------------ TRL


def trl_loss(logprobs: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
             old_logprobs: torch.Tensor, *, loss_type: str, epsilon_low: float = 0.2, epsilon_high: float = 0.28,
             beta: float = 0.0, ref_logprobs: torch.Tensor | None = None, use_bias_correction_kl: bool = True,
             entropy_coef: float = 0.0, importance_sampling_level: str = "token",
             importance_sampling_ratio: torch.Tensor | None = None, max_completion_length: int | None = None,
             sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05) -> torch.Tensor:
    """TRL's own `GRPOTrainer._compute_loss` on [B, T] inputs (one process, no gradient accumulation,
    training mode). `importance_sampling_ratio` turns on its vLLM correction with that ratio."""
    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, is_main_process=True,
                                  gather=lambda x: x, gather_for_metrics=lambda x: x,
                                  reduce=lambda x, reduction="sum": x)
    stand_in = SimpleNamespace(
        loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
        importance_sampling_level=importance_sampling_level, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=importance_sampling_ratio is not None,
        vllm_importance_sampling_correction=importance_sampling_ratio is not None,
        max_completion_length=max_completion_length or mask.shape[1], current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=entropy_coef > 0, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        aux_loss_enabled=False, model=SimpleNamespace(training=True), accelerator=accelerator,
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(use_bias_correction_kl=use_bias_correction_kl, delta=None, steps_per_generation=1,
                             sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg),
        # the one replaced helper: the model's per-token log-probs and entropies are the case's tensors
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logprobs, entropies, None),
    )
    rows, width = mask.shape
    inputs = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1, dtype=mask.dtype),
              "completion_ids": torch.zeros(rows, width, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old_logprobs, "num_items_in_batch": mask.sum()}
    if ref_logprobs is not None:
        inputs["ref_per_token_logps"] = ref_logprobs
    if importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_sampling_ratio
    return GRPOTrainer._compute_loss(stand_in, None, inputs)


def trl_token_truncate_ratio(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor,
                             clip_max: float) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio in `vllm_importance_sampling_mode="token_truncate"`
    (`_generate_and_score_completions`): exp((old - sampling) * mask), clamped at clip_max."""
    return torch.exp((old_logprobs - sampling_logprobs) * mask).clamp(max=clip_max)


def trl_group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, scale: bool = True) -> torch.Tensor:
    """TRL's `scale_rewards="group"` advantages (`_generate_and_score_completions`): reward minus the
    group mean, over TRL's `nanstd` (Bessel) of the group plus 1e-4; `scale=False`: "none"."""
    out = torch.empty_like(rewards)
    for group in torch.unique(group_ids):
        members = group_ids == group
        centred = rewards[members] - rewards[members].mean()
        out[members] = centred / (nanstd(rewards[members]) + 1e-4) if scale else centred
    return out


# ----------------------------------------------------------------------------------------------- verl


def verl_masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl.utils.torch_functional.masked_mean."""
    return (x * mask).sum() / mask.sum()


def verl_masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl.utils.torch_functional.masked_whiten (masked_var with Bessel over the mask's entries)."""
    mean = verl_masked_mean(x, mask)
    var = verl_masked_mean((x - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def _group_means(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, std (Bessel) and size; a group of one has mean 0 and std 1, as in verl."""
    mean, std, size = torch.zeros_like(scores), torch.ones_like(scores), torch.zeros_like(scores)
    for group in torch.unique(index):
        members = index == group
        size[members] = float(members.sum())
        if members.sum() > 1:
            mean[members], std[members] = scores[members].mean(), scores[members].std()
    return mean, std, size


def verl_grpo(scores: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, norm_by_std: bool = True,
              epsilon: float = 1e-6) -> torch.Tensor:
    """core_algos.compute_grpo_outcome_advantage (scores: each response's summed reward)."""
    mean, std, _ = _group_means(scores, index)
    advantages = (scores - mean) / (std + epsilon) if norm_by_std else scores - mean
    return advantages[:, None] * mask


def verl_rloo(scores: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """core_algos.compute_rloo_outcome_advantage: n/(n-1) (r - mean) for groups of two or more."""
    mean, _, size = _group_means(scores, index)
    loo = torch.where(size > 1, (scores - mean) * size / (size - 1).clamp(min=1), scores)
    return loo[:, None] * mask


def verl_reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """core_algos.compute_reinforce_plus_plus_outcome_advantage: discounted returns that restart at
    the end of each response, whitened over the response tokens."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return verl_masked_whiten(returns, mask) * mask


def verl_reinforce_pp_baseline(scores: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage: minus the group mean (0 for a
    group of one), tiled over the tokens, whitened over them."""
    mean, _, _ = _group_means(scores, index)
    tiled = (scores - mean)[:, None].expand_as(mask) * mask
    return verl_masked_whiten(tiled, mask) * mask


def verl_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
             lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """core_algos.compute_gae_advantage_return: TD errors and values of masked (observation) tokens
    are skipped, the next value and advantage carried across them; returns = raw advantages +
    values; advantages whitened over the mask."""
    next_value = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    out = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        current = delta + gamma * lam * last
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last = current * mask[:, t] + (1 - mask[:, t]) * last
        out[:, t] = last
    return verl_masked_whiten(out, mask), out + values


def verl_agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, scale_factor: float | None = None) -> torch.Tensor:
    """core_algos.agg_loss on one micro-batch (dp_size 1, batch sizes from the micro-batch)."""
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        tokens = mask.sum(-1)
        per_sequence = (loss * mask).sum(-1) / (tokens + 1e-8)
        present = (tokens > 0).to(loss.dtype)
        return (per_sequence * present).sum() / present.sum()
    if mode == "seq-mean-token-sum-norm":
        return (loss * mask).sum() / (scale_factor if scale_factor is not None else mask.shape[-1])
    raise ValueError(mode)


def _ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0))


def verl_vanilla(logprobs, old_logprobs, advantages, mask, mode, clip_low=0.2, clip_high=0.28, clip_c=3.0,
                 weights=None, scale_factor=None) -> torch.Tensor:
    """core_algos.compute_policy_loss_vanilla: clipped surrogate, dual clip at clip_c for A < 0
    (always on), times the rollout-correction weights, aggregated."""
    ratio = _ratio(logprobs, old_logprobs)
    clipped = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    loss = torch.where(advantages < 0, torch.minimum(-advantages * clip_c, clipped), clipped)
    return verl_agg_loss(loss if weights is None else loss * weights, mask, mode, scale_factor)


def verl_gspo(logprobs, old_logprobs, advantages, mask, clip_low=3e-4, clip_high=4e-4) -> torch.Tensor:
    """core_algos.compute_policy_loss_gspo: token ratio sg(s_i) * pi / sg(pi), s_i the exp of the mean
    log-ratio, clipped, aggregated seq-mean-token-mean."""
    seq = ((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_ratio = torch.clamp(logprobs - logprobs.detach() + seq.detach()[:, None], max=10.0)
    ratio = torch.exp(log_ratio)
    loss = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    return verl_agg_loss(loss, mask, "seq-mean-token-mean")


def verl_sapo(logprobs, old_logprobs, advantages, mask, tau_pos=1.0, tau_neg=1.05) -> torch.Tensor:
    """core_algos.compute_policy_loss_sapo: -(4/tau) sigmoid(tau (r - 1)) A, seq-mean-token-mean."""
    ratio = _ratio(logprobs, old_logprobs)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    return verl_agg_loss(-torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * advantages, mask, "seq-mean-token-mean")


def verl_cispo(logprobs, old_logprobs, advantages, mask, mode, clip_low=1.0, clip_high=0.28) -> torch.Tensor:
    """core_algos.compute_policy_loss_cispo: -sg(clip(r, 1 - low, 1 + high)) A log pi."""
    weight = torch.clamp(_ratio(logprobs, old_logprobs), 1 - clip_low, 1 + clip_high).detach()
    return verl_agg_loss(-weight * advantages * logprobs, mask, mode)


def verl_value_loss(predictions, old_values, returns, mask, clip) -> torch.Tensor:
    """core_algos.compute_value_loss: 0.5 token-mean of max((V - R)^2, (clip(V, V_old +- c) - R)^2)."""
    clipped = torch.clamp(predictions, old_values - clip, old_values + clip)
    return 0.5 * verl_agg_loss(torch.maximum((predictions - returns) ** 2, (clipped - returns) ** 2), mask,
                               "token-mean")


def verl_kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """core_algos.kl_penalty_forward: k1, k2 ("mse"), and "k3" = "low_var_kl" (clamped)."""
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    kl = torch.clamp(ref_logprobs - logprobs, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_rollout_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, threshold: float) -> torch.Tensor:
    """rollout_corr_helper.compute_rollout_correction_weights, rollout_is="token": exp of
    log(pi_old / pi_rollout) (safety-clamped), truncated at the threshold, detached."""
    return torch.exp(torch.clamp(old_logprobs - rollout_logprobs, min=-20, max=20)).clamp(max=threshold).detach()
