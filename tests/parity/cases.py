"""The parity cases: one list, run by tests/parity/test_parity.py and by `rlx bench parity`.

Every case builds the same random float64 batch for a seed (`batch`): 12 responses in groups of 5,
4 and 3, ragged lengths up to 16, PPO ratios inside and outside the clip band, tokens in dual-clip
range (ratio > 3 with A < 0) and tokens whose pi_old / mu is above the TIS cap of 2. Then it runs
rlx on it and the reference (tests/parity/references.py) on the same tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from rlx.algorithms import ADVANTAGE_ESTIMATORS, LossInputs, policy_objective
from rlx.algorithms.values import clipped_value_loss, gae, masked_whiten
from rlx.bench.parity import Case, Tensors
from rlx.config import AlgorithmConfig
from rlx.data.sample import Sample
from rlx.roles.advantages import Advantages
from tests.parity import references as ref

GROUPS = (5, 4, 3)
WIDTH = 16
CAP = 2.0


@dataclass(frozen=True)
class Batch:
    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    entropies: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    advantages: torch.Tensor  # [B], GRPO's of the rewards

    @property
    def token_advantages(self) -> torch.Tensor:
        return self.advantages[:, None].expand_as(self.logprobs)


def batch(seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    rows = sum(GROUPS)
    lengths = torch.randint(3, WIDTH + 1, (rows,), generator=gen)
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).double()
    group_ids = torch.repeat_interleave(torch.arange(len(GROUPS)), torch.tensor(GROUPS))
    rewards = torch.rand(rows, generator=gen, dtype=torch.float64)
    advantages = ADVANTAGE_ESTIMATORS.get("grpo")(rewards, group_ids)
    logprobs = -torch.rand(rows, WIDTH, generator=gen, dtype=torch.float64) * 3
    log_ratio = normal(rows, WIDTH, scale=0.25)
    log_ratio[:, 1] = math.log(3.5)  # in dual-clip range on every row with A < 0
    old = logprobs - log_ratio
    behaviour = normal(rows, WIDTH, scale=0.4)
    behaviour[:, 2] = math.log(3.0)  # pi_old / mu = 3, above the cap
    return Batch(logprobs, old, old - behaviour, logprobs - normal(rows, WIDTH, scale=0.4),
                 torch.rand(rows, WIDTH, generator=gen, dtype=torch.float64) * 2, mask, rewards, group_ids, advantages)


def _leaves(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    return b.logprobs.clone().requires_grad_(), b.entropies.clone().requires_grad_()


def _grads(loss: torch.Tensor, logprobs: torch.Tensor, entropies: torch.Tensor, with_entropy: bool) -> Tensors:
    out = {"loss": loss}
    if with_entropy:
        out["grad_logprobs"], out["grad_entropies"] = torch.autograd.grad(loss, [logprobs, entropies])
    else:
        out["grad_logprobs"] = torch.autograd.grad(loss, logprobs)[0]
    return out


def rlx_objective(b: Batch, **settings) -> Tensors:
    """rlx's whole policy objective (`policy_objective`) with AlgorithmConfig(**settings), one
    micro-batch holding the step."""
    config = AlgorithmConfig(**settings)
    logprobs, entropies = _leaves(b)
    inputs = LossInputs(logprobs, b.old_logprobs, b.token_advantages, b.mask,
                        rollout_logprobs=b.rollout_logprobs, ref_logprobs=b.ref_logprobs)
    loss, _ = policy_objective(inputs, entropies, config, float(b.mask.sum()), float(len(b.mask)))
    return _grads(loss, logprobs, entropies, config.entropy_coef > 0)


def trl_objective(b: Batch, is_ratio: bool = False, **settings) -> Tensors:
    logprobs, entropies = _leaves(b)
    ratio = ref.trl_token_truncate_ratio(b.old_logprobs, b.rollout_logprobs, b.mask, CAP) if is_ratio else None
    loss = ref.trl_loss(logprobs, entropies, b.mask, b.advantages, b.old_logprobs, ref_logprobs=b.ref_logprobs,
                        importance_sampling_ratio=ratio, **settings)
    return _grads(loss, logprobs, entropies, settings.get("entropy_coef", 0.0) > 0)


def versus_trl(rlx: dict, trl: dict, seed: int) -> tuple[Tensors, Tensors]:
    b = batch(seed)
    return rlx_objective(b, **rlx), trl_objective(b, **trl)


def trl_case(name, settings, rlx, trl, expect="match", reference=None) -> Case:
    shown = ", ".join(f"`{k}={v}`" for k, v in trl.items() if k != "is_ratio")
    if trl.get("is_ratio"):
        shown += ", vLLM IS `token_truncate` cap 2"
    return Case(name, reference or f"TRL 1.16 `_compute_loss`: {shown}", settings,
                partial(versus_trl, rlx, trl), expect)


CLIP = {"loss": {"clip_low": 0.2, "clip_high": 0.28}}
TRL_CASES = [
    trl_case("clipped surrogate, token-mean", "`loss.clip_high=0.28` (defaults)", CLIP, {"loss_type": "dapo"}),
    trl_case("clipped surrogate, token-mean", "defaults", CLIP, {"loss_type": "bnpo"}),
    trl_case("clipped surrogate, per-sequence mean", "`aggregation=seq-mean-token-mean`",
             {**CLIP, "aggregation": "seq-mean-token-mean"}, {"loss_type": "grpo"}),
    trl_case("Dr.GRPO", f"`aggregation=seq-mean-token-sum`, `loss_horizon={WIDTH}`",
             {**CLIP, "aggregation": "seq-mean-token-sum", "loss_horizon": WIDTH},
             {"loss_type": "dr_grpo", "max_completion_length": WIDTH}),
    trl_case("GSPO", "`loss={type: gspo}`, `aggregation=seq-mean-token-mean`",
             {"loss": {"type": "gspo"}, "aggregation": "seq-mean-token-mean"},
             {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon_low": 3e-4,
              "epsilon_high": 4e-4}),
    trl_case("SAPO", "`loss={type: sapo}`, `aggregation=seq-mean-token-mean`",
             {"loss": {"type": "sapo"}, "aggregation": "seq-mean-token-mean"}, {"loss_type": "sapo"}),
    trl_case("SAPO, rlx's default aggregation", "`loss={type: sapo}` (token-mean)", {"loss": {"type": "sapo"}},
             {"loss_type": "sapo"}, expect="convention"),
    trl_case("CISPO", "`loss={type: cispo}` (clip_high 0.28: cap 1.28)", {"loss": {"type": "cispo"}},
             {"loss_type": "cispo", "epsilon_high": 1.28}),
    trl_case("CISPO, the same number for the cap knob", "`loss={type: cispo}` (clip_high 0.28)",
             {"loss": {"type": "cispo"}}, {"loss_type": "cispo", "epsilon_high": 0.28}, expect="convention"),
    trl_case("KL k3, beta 0.05", "`kl_coef=0.05`, `kl_type=k3`", {**CLIP, "kl_coef": 0.05},
             {"loss_type": "dapo", "beta": 0.05, "use_bias_correction_kl": False}),
    trl_case("KL, TRL's default (k3 x ratio)", "`kl_coef=0.05`, `kl_type=k3_ratio`",
             {**CLIP, "kl_coef": 0.05, "kl_type": "k3_ratio"}, {"loss_type": "dapo", "beta": 0.05}),
    trl_case("KL, TRL's default against rlx's k3", "`kl_coef=0.05`, `kl_type=k3`", {**CLIP, "kl_coef": 0.05},
             {"loss_type": "dapo", "beta": 0.05}, expect="convention"),
    trl_case("entropy bonus, token-mean", "`entropy_coef=0.01`", {**CLIP, "entropy_coef": 0.01},
             {"loss_type": "dapo", "entropy_coef": 0.01}),
    trl_case("entropy bonus, per-sequence loss", "`entropy_coef=0.01`, `aggregation=seq-mean-token-mean`",
             {**CLIP, "entropy_coef": 0.01, "aggregation": "seq-mean-token-mean"},
             {"loss_type": "grpo", "entropy_coef": 0.01}, expect="convention"),
    trl_case("TIS, later update (pi != pi_old)", "`behavior_correction=tis`, `tis_cap=2`",
             {**CLIP, "behavior_correction": "tis", "tis_cap": CAP}, {"loss_type": "dapo", "is_ratio": True}),
    trl_case("decoupled, later update", "`behavior_correction=decoupled`, `tis_cap=2`",
             {**CLIP, "behavior_correction": "decoupled", "tis_cap": CAP}, {"loss_type": "dapo", "is_ratio": True}),
    trl_case("composite: clip-higher + KL + entropy + TIS", "`kl_coef=0.05`, `kl_type=k3_ratio`, "
             "`entropy_coef=0.01`, `behavior_correction=tis`",
             {**CLIP, "kl_coef": 0.05, "kl_type": "k3_ratio", "entropy_coef": 0.01, "behavior_correction": "tis",
              "tis_cap": CAP},
             {"loss_type": "dapo", "beta": 0.05, "entropy_coef": 0.01, "is_ratio": True}),
]


def _grpo_vs_trl(eps: float, seed: int, norm_std: bool = True) -> tuple[Tensors, Tensors]:
    b = batch(seed)
    ours = ADVANTAGE_ESTIMATORS.get("grpo")(b.rewards, b.group_ids, norm_std=norm_std, eps=eps)
    return {"advantages": ours}, {"advantages": ref.trl_group_advantages(b.rewards, b.group_ids, norm_std)}


TRL_ADVANTAGE_CASES = [
    Case("GRPO advantages", "TRL 1.16 `scale_rewards=\"group\"` (its formula, TRL's `nanstd`)", "`std_eps=1e-4`",
         partial(_grpo_vs_trl, 1e-4)),
    Case("GRPO advantages, rlx's default epsilon", "TRL 1.16 `scale_rewards=\"group\"`", "defaults (`std_eps=1e-6`)",
         partial(_grpo_vs_trl, 1e-6), "convention"),
    Case("Dr.GRPO advantages", "TRL 1.16 `scale_rewards=\"none\"` (its formula)", "`norm_std=false`",
         partial(_grpo_vs_trl, 1e-6, norm_std=False)),
]

# ----------------------------------------------------------------------------------------------- verl

VERL = "verl"


def _advantages_vs_verl(name: str, seed: int, **settings) -> tuple[Tensors, Tensors]:
    """rlx's estimator broadcast over the tokens against verl's token advantages (outcome reward on
    each response's last token, as verl's reward manager places it)."""
    b = batch(seed)
    tokens = b.mask.sum(1) if settings.pop("tokens", False) else None
    ours = ADVANTAGE_ESTIMATORS.get(name)(b.rewards, b.group_ids, tokens=tokens, **settings)[:, None] * b.mask
    last = (b.mask.sum(1) - 1).long()
    token_rewards = torch.zeros_like(b.mask)
    token_rewards[torch.arange(len(b.mask)), last] = b.rewards
    theirs = {
        "grpo": lambda: ref.verl_grpo(b.rewards, b.group_ids, b.mask, settings.get("norm_std", True)),
        "rloo": lambda: ref.verl_rloo(b.rewards, b.group_ids, b.mask),
        "reinforce_pp": lambda: ref.verl_reinforce_pp(token_rewards, b.mask),
        "reinforce_pp_baseline": lambda: ref.verl_reinforce_pp_baseline(b.rewards, b.group_ids, b.mask),
    }[name]()
    return {"advantages": ours}, {"advantages": theirs}


def advantage_case(name, verl_fn, settings, expect="match", **options) -> Case:
    return Case(f"{name} advantages", f"{VERL} {verl_fn}", settings,
                partial(_advantages_vs_verl, name, **options), expect)


def gae_batch(seed: int) -> tuple[list[Sample], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Agent-like samples: ragged responses whose loss masks have interior holes (observations),
    critic values everywhere; returned with the padded values, trained-token mask and token rewards."""
    gen = torch.Generator().manual_seed(100 + seed)
    samples, rows = [], []
    for uid in range(8):
        length = int(torch.randint(6, WIDTH + 1, (1,), generator=gen))
        mask = [1.0] * length
        start = int(torch.randint(1, length - 3, (1,), generator=gen))
        mask[start: start + 3] = [0.0, 0.0, 0.0]  # an observation between two turns
        values = (torch.randn(length, generator=gen, dtype=torch.float64) * 0.5).tolist()
        reward = float(torch.rand(1, generator=gen))
        samples.append(Sample(uid=uid, group_id=uid // 4, response_ids=[1] * length, loss_mask=mask,
                              values=values, reward=reward))
        rows.append((values, mask, reward))
    values, mask, token_rewards = (torch.zeros(len(rows), WIDTH, dtype=torch.float64) for _ in range(3))
    for i, (v, m, r) in enumerate(rows):
        values[i, : len(v)], mask[i, : len(m)] = torch.tensor(v), torch.tensor(m)
        token_rewards[i, len(m) - 1] = r
    return samples, values, mask, token_rewards


def _gae_vs_verl(gamma: float, lam: float, unbiased: bool, seed: int) -> tuple[Tensors, Tensors]:
    """rlx's GAE and whitening (float64, as the Advantages role composes them) against verl's GAE."""
    _, values, mask, token_rewards = gae_batch(seed)
    advantages, returns = gae(token_rewards, values, mask, gamma, lam)
    theirs, their_returns = ref.verl_gae(token_rewards, values, mask, gamma, lam)
    return ({"advantages": masked_whiten(advantages, mask, unbiased=unbiased), "returns": returns},
            {"advantages": theirs * mask, "returns": their_returns * mask})


def _gae_role_vs_verl(seed: int) -> tuple[Tensors, Tensors]:
    """The Advantages role itself (its float32 tensors, the loss mask from the samples) against verl."""
    samples, values, mask, token_rewards = gae_batch(seed)
    Advantages(AlgorithmConfig(advantage="gae", gamma=0.99, lam=0.95), filter_zero_std=False).compute(samples)
    ours = torch.zeros_like(values)
    for i, s in enumerate(samples):
        ours[i, : len(s.token_advantages)] = torch.tensor(s.token_advantages, dtype=torch.float64)
    theirs, _ = ref.verl_gae(token_rewards, values, mask, 0.99, 0.95)
    return {"advantages": ours}, {"advantages": theirs * mask}


def _value_loss_vs_verl(seed: int) -> tuple[Tensors, Tensors]:
    b = batch(seed)
    old, returns = b.ref_logprobs, b.old_logprobs  # any two fixed tensors
    sides = []
    for side in ("rlx", "verl"):
        predictions = b.logprobs.clone().requires_grad_()
        if side == "rlx":  # the Critic's loss: summed per token, token-mean over the step
            loss = (clipped_value_loss(predictions, old, returns, 0.2) * b.mask).sum() / b.mask.sum()
        else:
            loss = ref.verl_value_loss(predictions, old, returns, b.mask, 0.2)
        sides.append({"loss": loss, "grad_values": torch.autograd.grad(loss, predictions)[0]})
    return sides[0], sides[1]


def _loss_vs_verl(rlx: dict, verl: callable, seed: int) -> tuple[Tensors, Tensors]:
    b = batch(seed)
    ours = rlx_objective(b, **rlx)
    logprobs, entropies = _leaves(b)
    loss = verl(b, logprobs, entropies)
    return ours, _grads(loss, logprobs, entropies, AlgorithmConfig(**rlx).entropy_coef > 0)


def verl_case(name, verl_fn, settings, rlx, verl, expect="match") -> Case:
    return Case(name, f"{VERL} {verl_fn}", settings, partial(_loss_vs_verl, rlx, verl), expect)


def _vanilla(mode="token-mean", clip_c=3.0, weights=False):
    def run(b, logprobs, entropies):
        w = ref.verl_rollout_weights(b.old_logprobs, b.rollout_logprobs, CAP) if weights else None
        return ref.verl_vanilla(logprobs, b.old_logprobs, b.token_advantages, b.mask, mode, clip_c=clip_c, weights=w)
    return run


def _kl_only(kind):
    def run(b, logprobs, entropies):
        return 0.05 * ref.verl_agg_loss(ref.verl_kl_penalty(logprobs, b.ref_logprobs, kind), b.mask, "token-mean")
    return run


def _far_reference(rlx: dict, kind: str, seed: int) -> tuple[Tensors, Tensors]:
    """KL terms with a few tokens far below the reference (log pi - log ref = -25 and -8)."""
    b = batch(seed)
    far = b.ref_logprobs.clone()
    far[:, 3], far[:, 4] = b.logprobs[:, 3] + 25.0, b.logprobs[:, 4] + 8.0
    b = Batch(**{**b.__dict__, "ref_logprobs": far})
    ours = rlx_objective(b, **rlx)
    logprobs, entropies = _leaves(b)
    return ours, _grads(_zero_policy(b, logprobs) + _kl_only(kind)(b, logprobs, entropies), logprobs, entropies, False)


def _zero_policy(b: Batch, logprobs: torch.Tensor) -> torch.Tensor:
    """verl's token-mean clipped surrogate without dual clip (a c it never reaches), as rlx's default."""
    return ref.verl_vanilla(logprobs, b.old_logprobs, b.token_advantages, b.mask, "token-mean", clip_c=1e12)


NO_DUAL = 1e12  # a dual-clip bound no ratio reaches: verl's vanilla without dual clip
VERL_CASES = [
    advantage_case("grpo", "`compute_grpo_outcome_advantage`", "defaults"),
    advantage_case("grpo", "`compute_grpo_outcome_advantage` (`norm_adv_by_std_in_grpo=False`)",
                   "`norm_std=false` (Dr.GRPO)", norm_std=False),
    advantage_case("rloo", "`compute_rloo_outcome_advantage`", "`advantage=rloo`"),
    advantage_case("reinforce_pp", "`compute_reinforce_plus_plus_outcome_advantage` (gamma 1)",
                   "`reinforce_pp_normalize=tokens`", tokens=True),
    advantage_case("reinforce_pp", "`compute_reinforce_plus_plus_outcome_advantage`", "defaults (over responses)",
                   "convention"),
    advantage_case("reinforce_pp_baseline", "`compute_reinforce_plus_plus_baseline_outcome_advantage`",
                   "`reinforce_pp_normalize=tokens`", tokens=True),
    advantage_case("reinforce_pp_baseline", "`compute_reinforce_plus_plus_baseline_outcome_advantage`",
                   "defaults (over responses)", "convention"),
    Case("GAE + whitening, loss mask with holes, gamma 0.99 lam 0.95", f"{VERL} `compute_gae_advantage_return`",
         "`advantage=gae` (Bessel whitening, the default)", partial(_gae_vs_verl, 0.99, 0.95, True)),
    Case("GAE + whitening, loss mask with holes, gamma 1 lam 1", f"{VERL} `compute_gae_advantage_return`",
         "`advantage=gae`, `gamma=1`, `lam=1`", partial(_gae_vs_verl, 1.0, 1.0, True)),
    Case("GAE + whitening, population variance", f"{VERL} `compute_gae_advantage_return`",
         "`whiten_variance=population`", partial(_gae_vs_verl, 0.99, 0.95, False), "convention"),
    Case("GAE, the Advantages role on agent samples (float32)", f"{VERL} `compute_gae_advantage_return`",
         "`advantage=gae`, `gamma=0.99`, `lam=0.95`", _gae_role_vs_verl),
    Case("clipped value loss, token-mean", f"{VERL} `compute_value_loss`", "`critic.value_clip=0.2`",
         _value_loss_vs_verl),
    verl_case("clipped surrogate + dual clip 3, token-mean", "`compute_policy_loss_vanilla` (`clip_ratio_c=3`)",
              "`loss.dual_clip=3`", {"loss": {"clip_high": 0.28, "dual_clip": 3.0}}, _vanilla()),
    verl_case("clipped surrogate, rlx's default (no dual clip)", "`compute_policy_loss_vanilla` (its default c=3)",
              "defaults", CLIP, _vanilla(), "convention"),
    verl_case("clipped surrogate, no dual clip", "`compute_policy_loss_vanilla` (c never reached)", "defaults",
              CLIP, _vanilla(clip_c=NO_DUAL)),
    verl_case("aggregation seq-mean-token-mean", "`agg_loss(\"seq-mean-token-mean\")`",
              "`aggregation=seq-mean-token-mean`, `loss.dual_clip=3`",
              {"loss": {"dual_clip": 3.0}, "aggregation": "seq-mean-token-mean"}, _vanilla("seq-mean-token-mean")),
    verl_case("aggregation seq-mean-token-sum-norm / B", f"`agg_loss(\"seq-mean-token-sum-norm\", "
              f"loss_scale_factor={WIDTH})` divided by the number of sequences B (a pure scale)",
              f"`aggregation=seq-mean-token-sum`, `loss_horizon={WIDTH}`, `loss.dual_clip=3`",
              {"loss": {"dual_clip": 3.0}, "aggregation": "seq-mean-token-sum", "loss_horizon": WIDTH},
              lambda b, lp, e: ref.verl_vanilla(lp, b.old_logprobs, b.token_advantages, b.mask,
                                                "seq-mean-token-sum-norm", scale_factor=WIDTH) / len(b.mask)),
    verl_case("GSPO", "`compute_policy_loss_gspo`", "`loss={type: gspo}`, `aggregation=seq-mean-token-mean`",
              {"loss": {"type": "gspo"}, "aggregation": "seq-mean-token-mean"},
              lambda b, lp, e: ref.verl_gspo(lp, b.old_logprobs, b.token_advantages, b.mask)),
    verl_case("SAPO", "`compute_policy_loss_sapo`", "`loss={type: sapo}`, `aggregation=seq-mean-token-mean`",
              {"loss": {"type": "sapo"}, "aggregation": "seq-mean-token-mean"},
              lambda b, lp, e: ref.verl_sapo(lp, b.old_logprobs, b.token_advantages, b.mask)),
    verl_case("CISPO", "`compute_policy_loss_cispo` (`clip_ratio_low=1`, `clip_ratio_high=0.28`)",
              "`loss={type: cispo}`", {"loss": {"type": "cispo"}},
              lambda b, lp, e: ref.verl_cispo(lp, b.old_logprobs, b.token_advantages, b.mask, "token-mean")),
    *[verl_case(f"KL {kind}, coef 0.05", f"`kl_penalty(\"{theirs}\")`", f"`kl_coef=0.05`, `kl_type={kind}`",
                {**CLIP, "kl_coef": 0.05, "kl_type": kind},
                lambda b, lp, e, theirs=theirs: _zero_policy(b, lp) + _kl_only(theirs)(b, lp, e))
      for kind, theirs in (("k1", "k1"), ("k2", "k2"), ("low_var", "low_var_kl"))],
    Case("KL low_var, tokens far from the reference", f"{VERL} `kl_penalty(\"k3\")` (= low_var_kl)",
         "`kl_type=low_var`", partial(_far_reference, {**CLIP, "kl_coef": 0.05, "kl_type": "low_var"}, "k3")),
    Case("KL k3, tokens far from the reference", f"{VERL} `kl_penalty(\"k3\")` (clamped)",
         "`kl_type=k3` (unclamped)", partial(_far_reference, {**CLIP, "kl_coef": 0.05}, "k3"), "convention"),
    verl_case("entropy bonus, seq-mean-token-mean", "policy loss - coef x `agg_loss(entropy)` (dp_actor)",
              "`entropy_coef=0.01`, `aggregation=seq-mean-token-mean`, `loss.dual_clip=3`",
              {"loss": {"dual_clip": 3.0}, "entropy_coef": 0.01, "aggregation": "seq-mean-token-mean"},
              lambda b, lp, e: _vanilla("seq-mean-token-mean")(b, lp, e)
              - 0.01 * ref.verl_agg_loss(e, b.mask, "seq-mean-token-mean")),
    verl_case("TIS, later update (pi != pi_old)", "`compute_rollout_correction_weights(token, 2)` + vanilla",
              "`behavior_correction=tis`, `tis_cap=2`", {**CLIP, "behavior_correction": "tis", "tis_cap": CAP},
              _vanilla(clip_c=NO_DUAL, weights=True)),
    verl_case("composite: dual clip + low_var KL + entropy + TIS", "dp_actor: vanilla (c=3) with rollout "
              "weights + 0.05 `kl_penalty(\"low_var_kl\")` - 0.01 entropy",
              "`loss.dual_clip=3`, `kl_coef=0.05`, `kl_type=low_var`, `entropy_coef=0.01`, `behavior_correction=tis`",
              {"loss": {"dual_clip": 3.0}, "kl_coef": 0.05, "kl_type": "low_var", "entropy_coef": 0.01,
               "behavior_correction": "tis", "tis_cap": CAP},
              lambda b, lp, e: _vanilla(weights=True)(b, lp, e) + _kl_only("low_var_kl")(b, lp, e)
              - 0.01 * ref.verl_agg_loss(e, b.mask, "token-mean")),
]


CASES: list[Case] = [*TRL_CASES, *TRL_ADVANTAGE_CASES, *VERL_CASES]
