"""Unit tests for rlx.algorithms: advantages, clipped loss, KL estimators, aggregation, objective."""

from __future__ import annotations

import math

import pytest
import torch

from rlx.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    LossInputs,
    aggregate,
    clipped_policy_loss,
    grpo_advantages,
    kl_estimate,
    policy_objective,
)
from rlx.algorithms.objective import truncated_importance_weight
from rlx.config import AlgorithmConfig, ClippedLoss
from rlx.registry import Registry

EPS = 1e-6


# --------------------------------------------------------------------------------------------- GRPO


def test_grpo_two_groups_of_four_normalised():
    # group 0: [1,0,0,1] -> mean 0.5, deviations +-0.5, unbiased var = 4*0.25/3 = 1/3, std = 0.577350
    #   A = +-0.5 / (0.577350 + 1e-6) = +-0.866024
    # group 1: [1,1,0,0] -> same statistics, same magnitudes
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    std = math.sqrt(1 / 3)
    a = 0.5 / (std + EPS)
    expected = torch.tensor([a, -a, -a, a, a, a, -a, -a])
    out = grpo_advantages(rewards, groups, norm_std=True)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    # matches torch.std's default (unbiased) estimator
    torch.testing.assert_close(out[:4], (rewards[:4] - rewards[:4].mean()) / (rewards[:4].std() + EPS))


def test_grpo_group_of_three_hand_values():
    # [3,0,0]: mean 1, deviations [2,-1,-1], unbiased var = (4+1+1)/2 = 3, std = 1.732051
    # A = [2/1.732051, -1/1.732051, -1/1.732051] = [1.154700, -0.577350, -0.577350]
    out = grpo_advantages(torch.tensor([3.0, 0.0, 0.0]), torch.tensor([5, 5, 5]))
    torch.testing.assert_close(out, torch.tensor([1.154700, -0.577350, -0.577350]), atol=1e-5, rtol=0)


def test_grpo_without_std_normalisation_is_mean_centred_only():
    # [3,0,0] -> mean 1 -> [2,-1,-1]; [1,0,0,1] -> mean .5 -> [.5,-.5,-.5,.5]
    rewards = torch.tensor([3.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    out = grpo_advantages(rewards, groups, norm_std=False)
    torch.testing.assert_close(out, torch.tensor([2.0, -1.0, -1.0, 0.5, -0.5, -0.5, 0.5]))


def test_grpo_group_of_one_and_constant_group_get_zero():
    rewards = torch.tensor([0.7, 1.0, 1.0, 1.0])
    groups = torch.tensor([3, 8, 8, 8])
    for norm in (True, False):
        out = grpo_advantages(rewards, groups, norm_std=norm)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, torch.zeros(4))


def test_grpo_non_contiguous_unsorted_group_ids():
    # group 7 -> rows 0,2 rewards [1,0]: mean .5, std = sqrt(.5/1) = .707107 -> [+.707106, -.707106]
    # group 2 -> rows 1,3 rewards [0,2]: mean 1, std = sqrt(2/1) = 1.414214 -> [-.707107, +.707107]
    # group 9 -> row 4 alone -> 0
    # without std: rows [1-.5, 0-1, 0-.5, 2-1, 0] = [.5, -1, -.5, 1, 0]
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 5.0])
    groups = torch.tensor([7, 2, 7, 2, 9])
    out = grpo_advantages(rewards, groups)
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(out, torch.tensor([s, -s, -s, s, 0.0]), atol=2e-6, rtol=0)
    out_raw = grpo_advantages(rewards, groups, norm_std=False)
    torch.testing.assert_close(out_raw, torch.tensor([0.5, -1.0, -0.5, 1.0, 0.0]))


def test_grpo_integer_rewards_are_accepted():
    out = grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), norm_std=False)
    assert out.dtype.is_floating_point
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5]))


# ------------------------------------------------------------------------------------ clipped loss


def _ratios_to_logprobs(ratios, old):
    return old + torch.log(torch.tensor(ratios))


def _clipped(logp, old, adv, **knobs):
    return clipped_policy_loss(LossInputs(logp, old, adv, torch.ones_like(adv)), ClippedLoss(**knobs))


def test_clipped_loss_hand_values_with_clip_higher():
    # clip_low = 0.2 (lower bound 0.8), clip_high = 0.28 (upper bound 1.28)
    # ratio  A   unclipped  clipped      min    loss  clipped-branch
    # 1.10   2   2.2        2.2          2.2   -2.2   0
    # 1.25   1   1.25       1.25         1.25  -1.25  0   (inside 1.28: clip-higher lets it through)
    # 1.30   1   1.3        1.28         1.28  -1.28  1
    # 0.70   1   0.7        0.8          0.7   -0.7   0   (A>0 is never clipped below)
    # 0.70  -1  -0.7       -0.8         -0.8    0.8   1
    # 1.50  -1  -1.5       -1.28        -1.5    1.5   0   (A<0 is never clipped above)
    # 0.90  -1  -0.9       -0.9         -0.9    0.9   0
    ratios = [1.10, 1.25, 1.30, 0.70, 0.70, 1.50, 0.90]
    adv = torch.tensor([2.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.1, -2.2])
    logp = _ratios_to_logprobs(ratios, old)
    loss, clipped = _clipped(logp, old, adv, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([-2.2, -1.25, -1.28, -0.7, 0.8, 1.5, 0.9]), atol=1e-5, rtol=0)
    torch.testing.assert_close(clipped, torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]))
    assert clipped.dtype == torch.float32


def test_clip_higher_asymmetry_vs_symmetric():
    # ratio 1.25 with A=1: symmetric clip 0.2 -> min(1.25, 1.2) = 1.2 (clipped), clip_high .28 -> 1.25
    old = torch.zeros(1)
    logp = _ratios_to_logprobs([1.25], old)
    adv = torch.ones(1)
    sym_loss, sym_clipped = _clipped(logp, old, adv, clip_low=0.2, clip_high=0.2)
    asym_loss, asym_clipped = _clipped(logp, old, adv, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(sym_loss, torch.tensor([-1.2]))
    assert sym_clipped.item() == 1.0
    torch.testing.assert_close(asym_loss, torch.tensor([-1.25]))
    assert asym_clipped.item() == 0.0
    # the lower bound uses clip_low, not clip_high: ratio .75 with A=-1 -> clipped at .8 -> loss .8
    low_loss, low_clipped = _clipped(
        _ratios_to_logprobs([0.75], old), old, -adv, clip_low=0.2, clip_high=0.28
    )
    torch.testing.assert_close(low_loss, torch.tensor([0.8]))
    assert low_clipped.item() == 1.0


def test_clipped_loss_gradient_is_zero_where_clipped():
    # d loss / d logp = -ratio * A on the unclipped branch, 0 on the clipped branch
    ratios = [1.10, 1.25, 1.30, 0.70, 0.70, 1.50]
    adv = torch.tensor([2.0, 1.0, 1.0, 1.0, -1.0, -1.0])
    old = torch.zeros(6)
    logp = _ratios_to_logprobs(ratios, old).requires_grad_(True)
    loss, clipped = _clipped(logp, old, adv, clip_low=0.2, clip_high=0.28)
    loss.sum().backward()
    expected = torch.tensor([-2.2, -1.25, 0.0, -0.7, 0.0, 1.5])
    torch.testing.assert_close(logp.grad, expected, atol=1e-5, rtol=0)
    assert torch.all(logp.grad[clipped.bool()] == 0)
    assert torch.all(logp.grad[~clipped.bool()] != 0)


def test_clipped_loss_ratio_one_is_minus_advantage():
    adv = torch.tensor([[0.3, -1.7], [2.0, 0.0]])
    lp = torch.randn(2, 2)
    loss, clipped = _clipped(lp, lp.clone(), adv, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, -adv)
    assert clipped.sum() == 0


# --------------------------------------------------------------------------------------------- KL


def test_kl_estimators_hand_values():
    # logp=-1, ref=-2 -> log r = 1: k1 = 1, k2 = .5, k3 = e^-1 - 1 + 1 = 0.367879
    # logp=-2, ref=-1 -> log r = -1: k1 = -1, k2 = .5, k3 = e^1 - 1 - 1 = 0.718282
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-2.0, -1.0])
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([0.367879, 0.718282]), atol=1e-6, rtol=0)
    # default kind is k3
    torch.testing.assert_close(kl_estimate(logp, ref), kl_estimate(logp, ref, "k3"))


def test_kl_estimators_zero_when_equal():
    lp = torch.tensor([-0.3, -4.0, -11.0])
    for kind in ("k1", "k2", "k3"):
        torch.testing.assert_close(kl_estimate(lp, lp.clone(), kind), torch.zeros(3))


def test_k3_is_non_negative():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(1000, generator=gen) * 3
    ref = torch.randn(1000, generator=gen) * 3
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert (kl_estimate(logp, ref, "k2") >= 0).all()


def _expected_kl_term_gradient(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E_{y ~ pi}[grad of the term at y] w.r.t. the logits of a categorical pi, summed exactly over the
    vocabulary, with the gradients of KL(pi || ref) and KL(ref || pi) for comparison (float64)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, dtype=torch.float64, generator=gen).requires_grad_()
    ref = torch.log_softmax(torch.randn(7, dtype=torch.float64, generator=gen), -1)
    logp = torch.log_softmax(logits, -1)
    term = kl_estimate(logp, ref, kind)  # every token y, as if sampled
    expected = (logp.exp().detach() * term).sum()  # the sampling distribution is not differentiated
    (grad,) = torch.autograd.grad(expected, logits, retain_graph=True)
    reverse = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), logits, retain_graph=True)[0]
    forward = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), logits)[0]
    return grad, reverse, forward


@pytest.mark.parametrize(("kind", "target"), [("k1", "zero"), ("k2", "reverse"), ("k3", "forward"),
                                              ("low_var", "forward"), ("k3_ratio", "reverse")])
def test_each_kl_term_has_the_expected_gradient_the_docs_name(kind, target):
    grad, reverse, forward = _expected_kl_term_gradient(kind)
    want = {"zero": torch.zeros_like(grad), "reverse": reverse, "forward": forward}[target]
    torch.testing.assert_close(grad, want, atol=1e-12, rtol=0)
    assert not torch.allclose(reverse, forward, atol=1e-3)  # the two targets are distinguishable here


def test_k3_ratio_weights_k3_by_the_ratio_to_the_old_policy():
    logp, ref, old = torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5])
    torch.testing.assert_close(kl_estimate(logp, ref, "k3_ratio", old),
                               kl_estimate(logp, ref, "k3") * math.exp(0.5))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3_ratio"), kl_estimate(logp, ref, "k3"))  # on-policy


def test_kl_unknown_kind_raises():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


# -------------------------------------------------------------------------------------- aggregate

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_aggregate_token_mean_hand():
    # masked tokens: 1, 2, 4 -> sum 7 over 3 tokens = 2.333333
    out = aggregate(VALUES, MASK, "token-mean", global_tokens=3, global_sequences=2)
    assert out.item() == pytest.approx(7 / 3)


def test_aggregate_seq_mean_token_mean_hand():
    # row 0: (1+2)/2 = 1.5, row 1: 4/1 = 4 -> (1.5 + 4) / 2 = 2.75
    out = aggregate(VALUES, MASK, "seq-mean-token-mean", global_tokens=3, global_sequences=2)
    assert out.item() == pytest.approx(2.75)


@pytest.mark.parametrize("mode,full", [("token-mean", 7 / 3), ("seq-mean-token-mean", 2.75)])
def test_aggregate_halves_sum_to_full_batch(mode, full):
    tokens, seqs = float(MASK.sum()), float(MASK.shape[0])
    whole = aggregate(VALUES, MASK, mode, tokens, seqs)
    halves = aggregate(VALUES[:1], MASK[:1], mode, tokens, seqs) + aggregate(VALUES[1:], MASK[1:], mode, tokens, seqs)
    assert whole.item() == pytest.approx(full)
    assert halves.item() == pytest.approx(whole.item())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_aggregate_micro_batches_random(mode):
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.4).float()
    mask[:, 0] = 1.0
    tokens, seqs = float(mask.sum()), 6.0
    whole = aggregate(values, mask, mode, tokens, seqs)
    parts = sum(aggregate(values[i : i + 2], mask[i : i + 2], mode, tokens, seqs) for i in range(0, 6, 2))
    torch.testing.assert_close(parts, whole)


def test_aggregate_unknown_mode_raises():
    with pytest.raises(ValueError, match="sum"):
        aggregate(VALUES, MASK, "sum", 3, 2)


# ------------------------------------------------------------------------------------- objective


def test_policy_objective_combines_terms():
    # B=1, R=3, third token masked out (its garbage values must not matter)
    # ratio = 1 everywhere -> per-token policy loss = -A = [-1, -1, -100]; token-mean over 2 tokens = -1
    # ref = logp - 1 -> log r = 1 -> k3 = e^-1 = 0.367879 per token -> kl = 0.367879
    # entropy [2, 4, 1000] -> mean over mask = 3
    # loss = -1 + 0.1 * 0.367879 - 0.01 * 3 = -0.993212
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    entropy = torch.tensor([[2.0, 4.0, 1000.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    inputs = LossInputs(logp, old_logprobs=logp.detach().clone(), advantages=torch.tensor([[1.0, 1.0, 100.0]]),
                        mask=mask, ref_logprobs=logp.detach() - 1.0)
    config = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01, kl_type="k3", aggregation="token-mean")
    loss, metrics = policy_objective(inputs, entropy, config, global_tokens=2, global_sequences=1)
    expected = -1.0 + 0.1 * math.exp(-1) - 0.01 * 3.0
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert {"policy_loss", "kl", "entropy", "clip_fraction", "ratio_mean", "loss"} <= set(metrics)
    assert metrics["policy_loss"] == pytest.approx(-1.0)
    assert metrics["kl"] == pytest.approx(math.exp(-1), abs=1e-6)
    assert metrics["entropy"] == pytest.approx(3.0)
    assert metrics["loss"] == pytest.approx(expected, abs=1e-6)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    # loss = policy + kl_coef * kl - entropy_coef * entropy, as the metrics report it
    assert metrics["loss"] == pytest.approx(
        metrics["policy_loss"] + 0.1 * metrics["kl"] - 0.01 * metrics["entropy"], abs=1e-6
    )
    loss.backward()
    # d/dlogp: policy -A/2 = -0.5; kl k3' = (1 - e^-logr)/2 * 0.1 = (1 - e^-1) * 0.05 = 0.031606; masked token 0
    g = -0.5 + 0.05 * (1 - math.exp(-1))
    torch.testing.assert_close(logp.grad, torch.tensor([[g, g, 0.0]]), atol=1e-6, rtol=0)


def test_policy_objective_without_kl_needs_no_reference():
    logp = torch.tensor([[-1.0, -2.0]])
    inputs = LossInputs(logp, logp - math.log(1.5), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    # ratio 1.5 on both tokens: A=1 -> clipped at 1.28 -> -1.28 ; A=-1 -> min(-1.5, -1.28) = -1.5 -> 1.5
    # token-mean = (-1.28 + 1.5)/2 = 0.11 ; clip_fraction = 1/2 ; ratio_mean = 1.5
    config = AlgorithmConfig(kl_coef=0.0, entropy_coef=0.0)
    loss, metrics = policy_objective(inputs, torch.ones(1, 2), config, 2, 1)
    assert "kl" not in metrics
    assert loss.item() == pytest.approx(0.11, abs=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx(1.5, abs=1e-5)
    assert metrics["entropy"] == pytest.approx(1.0)  # reported even when its coefficient is 0


# --------------------------------------------------------------------------- off-policy corrections


def test_truncated_importance_weight_by_hand():
    # log pi - log mu = [0.5, -1.0, 1.5] -> pi/mu = [e^0.5, e^-1, e^1.5] = [1.648721, 0.367879, 4.481689]
    # cap 2 truncates only the last: [1.648721, 0.367879, 2.0]
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    behavior = torch.tensor([[-1.5, -1.0, -2.0]])
    weight = truncated_importance_weight(logp, behavior, cap=2.0)
    torch.testing.assert_close(weight, torch.tensor([[1.648721, 0.367879, 2.0]]), atol=1e-6, rtol=0)
    assert not weight.requires_grad  # a weight, never a path for the gradient
    # a cap of 1 keeps only down-weighting
    torch.testing.assert_close(truncated_importance_weight(logp, behavior, cap=1.0),
                               torch.tensor([[1.0, 0.367879, 1.0]]), atol=1e-6, rtol=0)


def _tis_case():
    """Three on-policy tokens (ratio 1), advantages [1, -2, 1], rollout log-probs giving
    pi/mu = [e^0.5, e^-1, e^1.5]."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    return logp, LossInputs(logp, logp.detach().clone(), torch.tensor([[1.0, -2.0, 1.0]]), torch.ones(1, 3),
                            rollout_logprobs=torch.tensor([[-1.5, -1.0, -2.0]]))


def test_policy_objective_with_tis_weights_each_token():
    # ratio 1 -> clipped loss per token = -A = [-1, 2, -1]
    # weights min(pi/mu, 2) = [1.648721, 0.367879, 2.0] (the last one capped)
    # per token -A w = [-1.648721, 0.735759, -2.0]; token-mean over 3 = -2.912962 / 3 = -0.970987
    logp, inputs = _tis_case()
    config = AlgorithmConfig(behavior_correction="tis", tis_cap=2.0)
    loss, metrics = policy_objective(inputs, torch.zeros(1, 3), config, 3, 1)
    assert loss.item() == pytest.approx(-0.970987, abs=1e-6)
    assert metrics["behavior_weight_mean"] == pytest.approx((1.648721 + 0.367879 + 2.0) / 3, abs=1e-6)
    loss.backward()
    # d/dlogp (-A r w / 3) with r = exp(logp - old), dr/dlogp = r = 1 and w detached: -A w / 3
    # = [-0.549574, 0.245253, -0.666667]. Were w not detached, token 0 would get twice that
    # (d(r w)/dlogp = 2 r w), and the capped token 2 would keep -2/3.
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.549574, 0.245253, -0.666667]]), atol=1e-6, rtol=0)


def test_policy_objective_with_decoupled_weights_by_the_proximal_policy():
    # PPO ratio against the proximal policy: r = pi / pi_prox = [1.1, 1.5]; A = [1, 1], clip_high 0.28
    #   token 0: min(1.1, 1.1) = 1.1 -> loss -1.1, gradient -r A = -1.1
    #   token 1: min(1.5, 1.28) = 1.28 (clipped) -> loss -1.28, gradient 0
    # weight min(pi_prox / mu, 2): mu = pi_prox + ln 2 -> 0.5 ; mu = pi_prox - ln 3 -> 3, capped at 2
    # per token [-0.55, -2.56]; token-mean over 2 = -1.555; gradient [-1.1 * 0.5 / 2, 0] = [-0.275, 0]
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    prox = torch.tensor([[-1.0 - math.log(1.1), -1.0 - math.log(1.5)]])
    inputs = LossInputs(logp, prox, torch.ones(1, 2), torch.ones(1, 2),
                        rollout_logprobs=prox + torch.tensor([[math.log(2.0), -math.log(3.0)]]))
    config = AlgorithmConfig(behavior_correction="decoupled", tis_cap=2.0, loss={"clip_high": 0.28})
    loss, metrics = policy_objective(inputs, torch.zeros(1, 2), config, 2, 1)
    assert loss.item() == pytest.approx(-1.555, abs=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["behavior_weight_mean"] == pytest.approx(1.25, abs=1e-6)  # (0.5 + 2) / 2
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.275, 0.0]]), atol=1e-6, rtol=0)


def test_tis_after_the_first_update_weights_by_the_old_policy_not_the_current_one():
    # A later update of a step: pi moved off pi_old. r = pi / pi_old = [1.1, 0.9], A = [1, -1],
    # clip 0.2/0.28 leaves both inside the band: per token -r A = [-1.1, 0.9].
    # pi_old / mu = [1.5, 3 (capped at 2)], so TIS weights [1.5, 2.0] (not pi / mu = [1.65, 2.0]).
    # token-mean over 2: (-1.1 * 1.5 + 0.9 * 2) / 2 = 0.075; gradient -A r w / 2 = [-0.825, 0.9]
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([[math.log(1.1), math.log(0.9)]], dtype=torch.float64)
    inputs = LossInputs(logp, old, torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2),
                        rollout_logprobs=old - torch.tensor([[math.log(1.5), math.log(3.0)]], dtype=torch.float64))
    config = AlgorithmConfig(behavior_correction="tis", tis_cap=2.0)
    loss, metrics = policy_objective(inputs, torch.zeros(1, 2, dtype=torch.float64), config, 2, 1)
    assert loss.item() == pytest.approx(0.075, abs=1e-12)
    assert metrics["behavior_weight_mean"] == pytest.approx(1.75, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.825, 0.9]], dtype=torch.float64), atol=1e-12, rtol=0)


def test_no_correction_ignores_the_rollout_logprobs():
    # same case as the TIS test without a correction: -A token-mean = (-1 + 2 - 1) / 3 = 0
    _, inputs = _tis_case()
    loss, metrics = policy_objective(inputs, torch.zeros(1, 3), AlgorithmConfig(behavior_correction="none"), 3, 1)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert "behavior_weight_mean" not in metrics


# ------------------------------------------------------------------------------------- registries


def test_registry_lookup():
    assert ADVANTAGE_ESTIMATORS.get("grpo") is grpo_advantages
    assert callable(POLICY_LOSSES.get("clipped"))
    assert "grpo" in ADVANTAGE_ESTIMATORS and "nope" not in ADVANTAGE_ESTIMATORS
    assert "clipped" in POLICY_LOSSES.names()


@pytest.mark.parametrize("registry,known", [(ADVANTAGE_ESTIMATORS, "grpo"), (POLICY_LOSSES, "clipped")])
def test_registry_unknown_name_names_known(registry, known):
    with pytest.raises(KeyError) as info:
        registry.get("does-not-exist")
    message = info.value.args[0]
    assert "does-not-exist" in message
    assert known in message


def test_registry_duplicate_registration_raises():
    reg: Registry = Registry("thing")
    reg.register("a")(len)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(max)
    assert reg.get("a") is len
    assert reg.names() == ["a"]


def test_behavior_kl_is_k3_of_the_behaviour_over_the_current_policy():
    from rlx.algorithms.objective import behavior_kl

    current = torch.log(torch.tensor([[0.5, 0.2]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.4]]))
    # r = pi/mu: 1 (no divergence), then 0.5: 0.5 - 1 - log 0.5 = 0.19315
    assert torch.allclose(behavior_kl(current, behaviour), torch.tensor([[0.0, 0.5 - 1 - math.log(0.5)]]), atol=1e-6)
