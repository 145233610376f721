"""Policy losses: per-token loss terms (aggregated later by `aggregate`), each registered by name.

Every registered loss has one signature, `(inputs: LossInputs, config) -> LossTerms`, where
`config` is the loss's own section of `algorithm.loss` (`ClippedLoss`, `GspoLoss`, ..., or
`CustomLoss` for one of yours), so the objective can swap them. POLICY_LOSSES is the plug-in
point: register `fn` under a name and select it with `algorithm.loss.type=custom` and
`algorithm.loss.name=<module>:<name>` (see `CustomLoss`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from rlx.registry import Registry

if TYPE_CHECKING:
    from rlx.config import CispoLoss, ClippedLoss, GspoLoss, LossConfig, SapoLoss


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss reads: every tensor is [B, R], one entry per response token.

    `advantages` is already broadcast to tokens. The optional inputs are None in a run without
    them: `rollout_logprobs`, the behaviour policy's (the rollout's, when its engine recorded them);
    `ref_logprobs`, the reference policy's (KL on); `teacher_logprobs` (a teacher in the run).
    `weights` is the per-token weight the objective multiplies the loss by (the behaviour
    correction's, detached), None without one: a loss may read it, the objective applies it.
    """

    logprobs: torch.Tensor  # the current policy's, with the gradient
    old_logprobs: torch.Tensor  # the policy the ratio is taken against (the proximal one)
    advantages: torch.Tensor
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def ratio(self) -> torch.Tensor:
        """r_t = pi(y_t) / pi_old(y_t), with the gradient of pi."""
        return torch.exp(self.logprobs - self.old_logprobs)


# The inputs above that are bus fields of the same name, per-token, read by the `train` task: the
# Actor builds each one its task reads (`plan.inputs("train")`); a test holds them to the plan.
BUS_INPUTS = ("old_logprobs", "rollout_logprobs", "ref_logprobs", "teacher_logprobs")


class LossTerms(NamedTuple):
    """[B, R] per-token loss, and 1.0 where the update was cut off (clipped, gated, bounded)."""

    loss: torch.Tensor
    cut: torch.Tensor


PolicyLoss = Callable[[LossInputs, Any], LossTerms]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def find_policy_loss(name: str) -> PolicyLoss:
    """The loss registered as `name`; `module:name` imports `module` first, so its registration runs
    in this process. Errors are ValueErrors that say what to fix (the config shows them as such)."""
    module, _, key = name.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"cannot import module {module!r} for policy loss {key!r}: {exc}") from None
    if key not in POLICY_LOSSES:
        raise ValueError(f"no policy loss {key!r} is registered (known: {', '.join(POLICY_LOSSES.names())}); register "
                         "it with @POLICY_LOSSES.register(name) in a module and set algorithm.loss.name=module:name")
    if key in BUILT_IN:
        raise ValueError(f"{key!r} is a built-in loss: set algorithm.loss.type={key} and its own keys instead")
    return POLICY_LOSSES.get(key)


def policy_loss_of(config: LossConfig) -> PolicyLoss:
    """The function for an `algorithm.loss` section: built-ins by `type`, custom ones by `name`."""
    return find_policy_loss(config.name) if config.type == "custom" else POLICY_LOSSES.get(config.type)


@POLICY_LOSSES.register("clipped")
def clipped_policy_loss(x: LossInputs, config: ClippedLoss) -> LossTerms:
    """PPO/GRPO clipped surrogate with separate bounds (DAPO clip-higher) and optional dual clip.

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), r_t = exp(logp_t - old_logp_t).
    Dual clip (A_t < 0 only): loss_t = min(loss_t, -dual_clip * A_t), bounding how hard one very
    unlikely-now token can push.
    """
    advantages = x.advantages
    ratio = x.ratio()
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped
    if config.dual_clip is not None:
        bound = -config.dual_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = was_clipped | dual
    return LossTerms(loss, was_clipped.float())


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] mean over response tokens of log(pi / pi_old): the log of GSPO's length-normalised ratio."""
    return ((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


@POLICY_LOSSES.register("gspo")
def gspo_loss(x: LossInputs, config: GspoLoss) -> LossTerms:
    """GSPO: one importance ratio per sequence, s_i = exp(mean_t log r_it), clipped like PPO.

    The sequence loss -min(s_i A_i, clip(s_i) A_i) is placed on every token of the sequence;
    aggregate with seq-mean-token-mean for the paper's sequence average.
    """
    seq_ratio = torch.exp(sequence_log_ratio(x.logprobs, x.old_logprobs, x.mask))[:, None]
    advantage = x.advantages[:, :1]  # GSPO advantages are per sequence
    unclipped = seq_ratio * advantage
    clipped = torch.clamp(seq_ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * advantage
    loss = -torch.minimum(unclipped, clipped)
    return LossTerms(loss.expand_as(x.logprobs), (clipped < unclipped).float().expand_as(x.logprobs))


@POLICY_LOSSES.register("sapo")
def sapo_loss(x: LossInputs, config: SapoLoss) -> LossTerms:
    """SAPO: a smooth gate instead of a hard clip. loss_t = -f(r_t) A_t, f(r) = (4/tau) sigmoid(tau (r - 1)).

    f'(1) = 1, so on-policy tokens get the plain policy gradient; the gradient fades smoothly as the
    ratio drifts, faster for negative advantages when tau_neg > tau_pos. The "cut off" indicator
    marks tokens whose gate weight f'(r) fell below one half.
    """
    ratio = x.ratio()
    tau = torch.where(x.advantages > 0, torch.full_like(ratio, config.tau_pos), torch.full_like(ratio, config.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * gate * x.advantages
    weight = 4.0 * gate * (1.0 - gate)
    return LossTerms(loss, (weight.detach() < 0.5).float())


@POLICY_LOSSES.register("cispo")
def cispo_loss(x: LossInputs, config: CispoLoss) -> LossTerms:
    """CISPO: loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t log pi(y_t).

    The importance weight is clipped and detached, so every token keeps a gradient (none is dropped
    as in PPO's clip); only its weight is bounded.
    """
    ratio = x.ratio().detach()
    weight = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    return LossTerms(-weight * x.advantages * x.logprobs, (weight != ratio).float())


BUILT_IN = frozenset(POLICY_LOSSES.names())
