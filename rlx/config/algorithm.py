"""The `algorithm`, `critic` and `teacher` sections: advantages, the policy loss, KL, off-policy
correction and MoE routing, with the rules that tie them to the rest of the run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, PrivateAttr, field_validator

from rlx.config.base import Section
from rlx.config.rollout import engine_named, reports_routes
from rlx.model_kinds import ROUTE_REPORTING_ENGINES, is_moe_model

if TYPE_CHECKING:
    from rlx.config.run import RunConfig

GROUP_RELATIVE = ("grpo", "rloo", "reinforce_pp_baseline")  # advantages relative to the group's rewards
Correction = Literal["none", "tis", "decoupled"]


class ClippedLoss(Section):
    """PPO/GRPO clipped surrogate; clip_high > clip_low is DAPO's clip-higher."""

    type: Literal["clipped"] = "clipped"
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="the ratio's lower bound is 1 - clip_low")
    clip_high: float = Field(0.28, ge=0.0, le=10.0, description="the ratio's upper bound is 1 + clip_high")
    dual_clip: float | None = Field(None, gt=1.0, description="dual-clip bound c for negative advantages (e.g. 3)")


class GspoLoss(Section):
    """GSPO: one length-normalised ratio per sequence, clipped much tighter than a token's."""

    type: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0.0, le=1.0)
    clip_high: float = Field(4e-4, ge=0.0, le=1.0)


class SapoLoss(Section):
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip."""

    type: Literal["sapo"] = "sapo"
    tau_pos: float = Field(1.0, gt=0.0, description="gate temperature for positive advantages")
    tau_neg: float = Field(1.05, gt=0.0, description="gate temperature for negative advantages")


class CispoLoss(Section):
    """CISPO: a clipped, detached importance weight on every token's log-prob."""

    type: Literal["cispo"] = "cispo"
    clip_low: float = Field(1.0, ge=0.0, le=1.0, description="the weight's floor is 1 - clip_low (1: none)")
    clip_high: float = Field(0.28, ge=0.0)


class CustomLoss(Section):
    """A policy loss of your own, registered in `rlx.algorithms.POLICY_LOSSES`.

    Register `fn(inputs: LossInputs, config: CustomLoss) -> LossTerms` with
    `@POLICY_LOSSES.register("my_loss")` in a module of yours, and select it with
    `algorithm.loss: {type: custom, name: "my_pkg.losses:my_loss", options: {...}}`. The part
    before the colon is imported first, in every process that builds the loss (Ray workers too),
    so its registration runs there; a bare `name` needs the registration to have run already (a
    program that registers, then starts a colocated run). A free-form `options` dict rather than a
    config class per plug-in keeps the union closed, so errors stay precise for built-in losses.
    """

    type: Literal["custom"] = "custom"
    name: str = Field(description="`module:registered_name`, or a name already in POLICY_LOSSES")
    options: dict[str, Any] = Field(default_factory=dict, description="free settings, read by the loss as "
                                    "config.options")

    @field_validator("name")
    @classmethod
    def _is_registered(cls, name: str) -> str:
        from rlx.algorithms.losses import find_policy_loss

        find_policy_loss(name)
        return name


LossConfig = Annotated[ClippedLoss | GspoLoss | SapoLoss | CispoLoss | CustomLoss, Field(discriminator="type")]
LOSS_CONFIGS: dict[str, type[Section]] = {"clipped": ClippedLoss, "gspo": GspoLoss, "sapo": SapoLoss,
                                          "cispo": CispoLoss, "custom": CustomLoss}
class AlgorithmConfig(Section):
    advantage: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "none"] = Field(
        "grpo", description="gae: PPO with a critic (section `critic`); none: no task advantage (distillation only)")
    loss: LossConfig = Field(default_factory=ClippedLoss, description="the policy loss and its knobs, chosen by "
                             "`type`: clipped (when type is left out), gspo, sapo, cispo, or custom")
    norm_std: bool = Field(True, description="divide GRPO advantages by the group std (false: Dr.GRPO)")
    std_eps: float = Field(1e-6, gt=0.0, description="added to the std (outside the square root) where GRPO and "
                           "REINFORCE++ (over responses) divide by it; TRL uses 1e-4, verl 1e-6")
    reinforce_pp_normalize: Literal["responses", "tokens"] = Field(
        "responses", description="REINFORCE++ (and _baseline): normalise over responses (each counts once), or over "
        "tokens as verl (a response weighs by its trained tokens; Bessel over tokens, rsqrt(var + 1e-8))")
    kl_coef: float = Field(0.0, ge=0.0)
    kl_reference_refresh_every: int = Field(
        0, ge=0, description="0: the KL reference is the initial policy; N: it takes the policy's weights every N "
        "steps (a periodically reset reference, as in ProRL)")
    kl_type: Literal["k1", "k2", "k3", "low_var", "k3_ratio"] = Field(
        "k3", description="the per-token KL term (docs/algorithms.md says which gradient each gives): k3 and "
        "low_var (k3 clamped to [0, 10]) pull along the forward KL(ref||pi), k2 and k3_ratio (k3 times the "
        "differentiable ratio pi/pi_old, TRL's default) along the reverse KL(pi||ref), k1 adds no gradient in "
        "expectation")
    entropy_coef: float = Field(0.0, ge=0.0)
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    loss_horizon: int = Field(1024, ge=1, description="constant divisor of seq-mean-token-sum (Dr.GRPO)")
    filter_zero_std_groups: bool = Field(True, description="skip groups whose rewards are all equal")
    dynamic_sampling: bool = Field(False, description="DAPO: refill the step with new groups for those filtered")
    max_groups_per_step: float = Field(3.0, ge=1.0, description="dynamic sampling stops a step after this many "
                                       "times prompts_per_step groups, trainable or not")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="GAE discount")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda")
    whiten_advantages: bool = Field(True, description="GAE: normalise token advantages over the trained tokens "
                                    "of each batch (observation tokens of agent samples excluded)")
    whiten_variance: Literal["unbiased", "population"] = Field(
        "unbiased", description="GAE whitening's variance: unbiased (Bessel's N-1 over the trained tokens, as verl) "
        "or population (divided by N, rlx before 2026-12)")
    behavior_correction: Literal["auto", "none", "tis", "decoupled"] = Field(
        "auto", description="off-policy correction against the rollout log-probs: tis (truncated importance "
        "sampling), decoupled (PPO ratio against ActorFwd's proximal policy, weight proximal/behaviour), none, or "
        "auto: decoupled in async mode with train.max_staleness > 0, else tis when rollout.engine is not hf or "
        "rollout.dtype differs from train.param_dtype, else none. Resolved once, when the RunConfig is "
        "validated; `rlx doctor` prints the result")
    tis_cap: float = Field(2.0, ge=1.0, description="truncation of the importance weight")
    routing_replay: Literal["auto", "off", "r3"] = Field(
        "auto", description="mixture-of-experts models: r3 (Rollout Routing Replay) routes every token, in every "
        "trainer forward (Actor, ActorFwd, Reference), to the experts the rollout engine chose; off: the trainer "
        "routes itself. auto: r3 for a MoE model whose engine reports routes (hf, vllm in-process, sglang), else off. r3 on a "
        "dense model is an error")
    routing_mismatch_every: int = Field(
        10, ge=0, description="R3: every N steps one extra forward without replay measures the rollout/trainer "
        "log-prob mismatch that replay removes (r3/logprob_abs_diff_without_replay); 0: never")
    router_aux_loss_coef: float = Field(
        0.0, ge=0.0, description="mixture-of-experts models: weight of the load-balancing loss (Switch: "
        "E * sum_e f_e P_e per MoE layer, averaged over layers), computed from the experts the forward used (the replayed "
        "ones under R3); 0: off (a dense model needs 0)")
    _resolved_correction: Correction | None = PrivateAttr(None)

    @field_validator("loss", mode="before")
    @classmethod
    def _clipped_by_default(cls, value: Any) -> Any:
        """`algorithm.loss.clip_high=0.2` alone tunes the default loss; a type not built in gets its fix."""
        if not isinstance(value, dict):
            return value
        kind = value.get("type", "clipped")
        if kind not in LOSS_CONFIGS:
            raise ValueError(f"algorithm.loss.type={kind!r} is not one of {', '.join(LOSS_CONFIGS)}; a loss "
                             "registered in POLICY_LOSSES is chosen with algorithm.loss.type=custom "
                             "algorithm.loss.name=module:name")
        return {**value, "type": kind}

    @property
    def resolved_correction(self) -> Correction:
        """The correction in effect: `auto` as the RunConfig holding this section resolved it. A lone
        AlgorithmConfig (unit tests, benches) resolves `auto` as a default run does: none."""
        if self.behavior_correction != "auto":
            return self.behavior_correction
        return self._resolved_correction or "none"


class CriticConfig(Section):
    """The value model of PPO (`algorithm.advantage=gae`): its own engine and optimizer."""

    path: str | None = Field(None, description="initial weights: a built-in name or HF folder (default: model.path)")
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    value_clip: float = Field(0.2, gt=0.0, description="clip of the value update around the old values")
    grad_clip: float = Field(1.0, gt=0.0)


class TeacherConfig(Section):
    """On-policy distillation: a Teacher role scores the student's sampled tokens."""

    path: str | None = Field(None, description="teacher model: built-in name or HF folder; unset = no teacher")
    coef: float = Field(1.0, gt=0.0, description="weight of the reverse-KL advantage")


def auto_correction(c: RunConfig) -> tuple[Correction, str]:
    """What `algorithm.behavior_correction` is in effect, and why (for `rlx doctor`).

    `auto`: decoupled when the trainer may get samples from older weights (async mode with
    max_staleness > 0; colocated runs always train on the current weights); else tis when the
    behaviour log-probs come from other numerics than the trainer's (another engine's kernels, or
    another dtype); else none.
    """
    t, r = c.train, c.rollout
    if c.algorithm.behavior_correction != "auto":
        return c.algorithm.behavior_correction, "set explicitly"
    if t.mode == "async" and t.max_staleness > 0:
        return "decoupled", f"train.max_staleness={t.max_staleness}: samples may come from older weights"
    if r.engine != "hf":
        return "tis", f"rollout.engine={r.engine} computes the behaviour log-probs with other kernels than the trainer"
    if r.dtype != t.param_dtype:
        return "tis", f"rollout.dtype={r.dtype} differs from the trainer's train.param_dtype={t.param_dtype}"
    return "none", "on-policy samples from the trainer's own engine and dtype"


def resolve_routing_replay(c: RunConfig) -> tuple[Literal["off", "r3"], str]:
    """Whether the trainer replays the rollout's expert routes (R3), and why (for `rlx doctor`)."""
    setting, moe = c.algorithm.routing_replay, is_moe_model(c.model.path)
    if setting != "auto":
        return setting, "set explicitly"
    if not moe:
        return "off", f"model.path={c.model.path!r} is not a mixture-of-experts model"
    if not reports_routes(c.rollout):
        return "off", f"{engine_named(c.rollout)} does not report the experts it routed to"
    return "r3", (f"model.path={c.model.path!r} is a mixture-of-experts model and "
                  f"rollout.engine={c.rollout.engine} reports its routes")


def conflicts(c: RunConfig) -> list[str]:
    """Advantage, loss, KL, teacher, critic and routing choices that cannot work together."""
    a, problems = c.algorithm, []
    if a.advantage == "none" and not c.uses_teacher:
        problems.append("algorithm.advantage=none trains on nothing without a teacher: set teacher.path=<model> "
                        "for on-policy distillation, or pick an advantage such as grpo")
    if a.advantage in GROUP_RELATIVE and c.rollout.n < 2:
        problems.append(f"algorithm.advantage={a.advantage} compares responses within a group: set rollout.n>=2, "
                        "or use advantage=gae (PPO with a critic) or reinforce_pp")
    if a.dynamic_sampling and not c.filters_zero_std_groups:
        problems.append("algorithm.dynamic_sampling refills groups dropped for equal rewards: it needs "
                        "algorithm.filter_zero_std_groups=true, a group-relative advantage (grpo, rloo, "
                        "reinforce_pp_baseline) and no teacher")
    if a.kl_reference_refresh_every and a.kl_coef <= 0:
        problems.append("algorithm.kl_reference_refresh_every refreshes the KL reference, but algorithm.kl_coef=0 "
                        "uses none: set kl_coef>0 (e.g. 0.05), or remove kl_reference_refresh_every")
    if c.critic.path is not None and not c.uses_critic:
        problems.append(f"critic.path is set but algorithm.advantage={a.advantage} uses no critic: "
                        "set algorithm.advantage=gae for PPO, or remove critic.path")
    if a.loss.type == "gspo" and (a.advantage == "gae" or c.uses_teacher):
        problems.append("algorithm.loss.type=gspo needs one advantage per sequence; gae and distillation give "
                        "one per token: use algorithm.loss.type=clipped")
    if a.loss.type == "gspo" and a.aggregation != "seq-mean-token-mean":
        problems.append(f"algorithm.loss.type=gspo averages its sequence losses over sequences; with "
                        f"aggregation={a.aggregation} its gradient is GRPO's: set algorithm.aggregation=seq-mean-token-mean")
    if a.routing_replay == "r3" and is_moe_model(c.model.path) is False:
        problems.append(f"algorithm.routing_replay=r3 replays mixture-of-experts routes, but model.path="
                        f"{c.model.path!r} is a dense model: set algorithm.routing_replay=off (or auto)")
    if a.router_aux_loss_coef > 0 and is_moe_model(c.model.path) is False:
        problems.append(f"algorithm.router_aux_loss_coef balances mixture-of-experts routers, but model.path="
                        f"{c.model.path!r} is a dense model: set algorithm.router_aux_loss_coef=0")
    if a.routing_replay == "r3" and not reports_routes(c.rollout):
        problems.append(f"algorithm.routing_replay=r3 needs the experts the engine routed to; {engine_named(c.rollout)} "
                        f"does not report them: use rollout.engine={' or '.join(sorted(ROUTE_REPORTING_ENGINES))} "
                        "(vllm in-process), or set algorithm.routing_replay=off")
    return problems


def uncorrected_staleness(c: RunConfig) -> str | None:
    if c.algorithm.behavior_correction == "none" and c.train.mode == "async" and c.train.max_staleness > 0:
        return (f"algorithm.behavior_correction=none with train.max_staleness={c.train.max_staleness}: "
                "samples from older weights train uncorrected, as if on-policy; set "
                "algorithm.behavior_correction=auto (decoupled here) or tis")
    return None


def idle_reinforce_pp_normalize(c: RunConfig) -> str | None:
    if c.algorithm.reinforce_pp_normalize == "tokens" and not c.algorithm.advantage.startswith("reinforce_pp"):
        return (f"algorithm.reinforce_pp_normalize=tokens has no effect with algorithm.advantage="
                f"{c.algorithm.advantage}: it applies to reinforce_pp and reinforce_pp_baseline")
    return None


def noisy_k1(c: RunConfig) -> str | None:
    if c.algorithm.kl_type == "k1" and c.algorithm.kl_coef > 0:
        return (f"algorithm.kl_type=k1 with kl_coef={c.algorithm.kl_coef}: k1's gradient is zero in "
                "expectation, so the KL term adds only noise; use kl_type=k3 (forward KL), k2 or k3_ratio "
                "(reverse KL)")
    return None
