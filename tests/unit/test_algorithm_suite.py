"""GSPO, SAPO, CISPO, dual clip, RLOO, REINFORCE++, low-variance KL and Dr.GRPO aggregation, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlx.algorithms import (
    LossInputs,
    aggregate,
    cispo_loss,
    clipped_policy_loss,
    gspo_loss,
    kl_estimate,
    policy_objective,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sapo_loss,
)
from rlx.config import AlgorithmConfig, CispoLoss, ClippedLoss, ConfigError, GspoLoss, SapoLoss, build_config
from tests.unit.loss_plugin import SEEN


def _inputs(logp: torch.Tensor, old: float, advantage: float) -> LossInputs:
    """One token: its log-prob `logp` ([1, 1]), the old log-prob and the advantage."""
    return LossInputs(logp, torch.tensor([[old]]), torch.tensor([[advantage]]), torch.ones(1, 1))


def test_rloo_leaves_one_out():
    # group [1, 0, 0, 1]: r_0 - mean(0, 0, 1) = 2/3 ; r_1 - mean(1, 0, 1) = -2/3 ; lone group -> 0
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0]), torch.tensor([0, 0, 0, 0, 1]))
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0], abs=1e-6)


def test_reinforce_pp_normalises_over_the_batch():
    # mean 0.5, unbiased std sqrt(1/3): (1 - 0.5) / 0.57735 = 0.8660
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert adv.tolist() == pytest.approx([0.8660, -0.8660, -0.8660, 0.8660], abs=1e-3)


def test_reinforce_pp_with_group_baseline():
    # minus group means -> [0.5, -0.5, 0, 0]; batch std sqrt(0.5 / 3) = 0.40825 -> [1.2247, -1.2247, 0, 0]
    adv = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert adv.tolist() == pytest.approx([1.2247, -1.2247, 0.0, 0.0], abs=1e-3)


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    # token log-ratios +0.1 and -0.1 average to 0: s = 1, loss -A on both tokens, gradient -A/2 each
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old, adv, mask = torch.tensor([[-1.1, -0.9]]), torch.full((1, 2), 2.0), torch.ones(1, 2)
    loss, clipped = gspo_loss(LossInputs(logp, old, adv, mask), GspoLoss(clip_low=3e-4, clip_high=4e-4))
    assert loss[0].tolist() == pytest.approx([-2.0, -2.0]) and clipped.sum() == 0
    aggregate(loss, mask, "seq-mean-token-mean", 2, 1).backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -1.0])


def test_gspo_clips_the_whole_sequence():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old, adv, mask = torch.full((1, 2), -0.5), torch.ones(1, 2), torch.ones(1, 2)  # s = e^0.5 = 1.6487
    loss, clipped = gspo_loss(LossInputs(logp, old, adv, mask), GspoLoss(clip_low=3e-4, clip_high=4e-4))
    assert loss[0, 0].item() == pytest.approx(-1.0004) and clipped.tolist() == [[1.0, 1.0]]
    loss.sum().backward()
    assert logp.grad.abs().sum() == 0


def test_sapo_gate_value_and_gradient():
    # on-policy: gate sigma(0) = 0.5, loss = -(4 / tau) * 0.5 * A; gradient w.r.t. logp = -A whatever tau
    for tau_pos in (0.5, 1.0, 2.0):
        logp = torch.tensor([[-1.0]], requires_grad=True)
        loss, _ = sapo_loss(_inputs(logp, -1.0, 3.0), SapoLoss(tau_pos=tau_pos, tau_neg=1.05))
        assert loss.item() == pytest.approx(-2.0 * 3.0 / tau_pos)
        loss.sum().backward()
        assert logp.grad.item() == pytest.approx(-3.0)
    # off-policy r = e: sigma(e - 1) = 0.8479, weight 4 s (1 - s) = 0.5158, gradient -0.5158 * e * A
    logp = torch.tensor([[0.0]], requires_grad=True)
    loss, weak = sapo_loss(_inputs(logp, -1.0, 1.0), SapoLoss(tau_pos=1.0, tau_neg=1.05))
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(-0.5158 * math.e, abs=1e-3)
    assert weak.item() == 0.0  # weight 0.52 is still above one half


def test_sapo_negative_advantages_use_their_own_temperature():
    logp = torch.tensor([[0.0]], requires_grad=True)
    loss, _ = sapo_loss(_inputs(logp, 0.0, -1.0), SapoLoss(tau_pos=1.0, tau_neg=2.0))
    assert loss.item() == pytest.approx(4.0 / 2.0 * 0.5)  # -(4 / tau_neg) * 0.5 * (-1)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # r = e^0.5 = 1.6487 > 1.28: weight 1.28 (detached); loss = -1.28 * A * logp ; d/dlogp = -1.28 A
    logp = torch.tensor([[-0.5]], requires_grad=True)
    loss, clipped = cispo_loss(_inputs(logp, -1.0, 2.0), CispoLoss(clip_low=1.0, clip_high=0.28))
    assert loss.item() == pytest.approx(-1.28 * 2.0 * -0.5) and clipped.item() == 1.0
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(-1.28 * 2.0)


def test_dual_clip_bounds_negative_advantages():
    # r = 5, A = -1: PPO loss max(5, 1.28) = 5; dual clip c = 3 caps it at 3 (and its gradient is 0)
    logp = torch.tensor([[math.log(5.0)]], requires_grad=True)
    loss, clipped = clipped_policy_loss(_inputs(logp, 0.0, -1.0), ClippedLoss(clip_high=0.28, dual_clip=3.0))
    assert loss.item() == pytest.approx(3.0) and clipped.item() == 1.0
    loss.sum().backward()
    assert logp.grad.item() == 0.0
    plain, _ = clipped_policy_loss(_inputs(logp, 0.0, -1.0), ClippedLoss(clip_high=0.28))
    assert plain.item() == pytest.approx(5.0)


def test_low_variance_kl_is_bounded():
    huge = kl_estimate(torch.tensor([-30.0]), torch.tensor([-10.0]), "low_var")
    assert huge.item() == 10.0
    small = kl_estimate(torch.tensor([-1.0]), torch.tensor([-2.0]), "low_var")
    assert small.item() == pytest.approx(math.exp(-1), abs=1e-6)


def test_seq_mean_token_sum_is_length_agnostic():
    values, mask = torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert aggregate(values, mask, "seq-mean-token-sum", 3, 2, horizon=4).item() == pytest.approx(0.75)


@pytest.mark.parametrize("loss", ["clipped", "gspo", "sapo", "cispo"])
def test_every_registered_loss_runs_through_the_objective(loss):
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = LossInputs(logp, torch.tensor([[-1.0, -2.0]]), torch.full((1, 2), 1.0), torch.ones(1, 2))
    total, metrics = policy_objective(inputs, torch.ones(1, 2), AlgorithmConfig(loss={"type": loss}), 2, 1)
    total.backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0 and "clip_fraction" in metrics


def test_a_user_registered_loss_is_selected_by_module_and_name():
    # tests.unit.loss_plugin registers scaled_pg (-scale * A * logp) when imported by the config check.
    # logp [-1, -2], A [1, 1], scale 0.5: per token [0.5, 1.0]; token-mean 0.75; gradient -0.5 * A / 2 = -0.25
    config = build_config({"algorithm": {"loss": {"type": "custom", "name": "tests.unit.loss_plugin:scaled_pg",
                                                  "options": {"scale": 0.5}}}}).algorithm
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = LossInputs(logp, logp.detach(), torch.ones(1, 2), torch.ones(1, 2))
    total, metrics = policy_objective(inputs, torch.ones(1, 2), config, 2, 1)
    assert total.item() == pytest.approx(0.75) and metrics["clip_fraction"] == 0.0
    total.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.25, -0.25])


def test_a_user_loss_gets_the_optional_inputs_of_the_run_and_the_correction_weight():
    # KL on and TIS: the loss sees the reference's and the rollout's log-probs, and the weight
    # min(pi_old / mu, 2) = min(e^[0.5, 1.0], 2) = [1.648721, 2.0] that the objective applies
    config = build_config({"algorithm": {"kl_coef": 0.1, "behavior_correction": "tis", "tis_cap": 2.0,
                                         "loss": {"type": "custom", "name": "tests.unit.loss_plugin:recording"}}}
                          ).algorithm
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref, rollout = torch.tensor([[-1.5, -2.5]]), torch.tensor([[-1.5, -3.0]])
    inputs = LossInputs(logp, logp.detach(), torch.ones(1, 2), torch.ones(1, 2), rollout_logprobs=rollout,
                        ref_logprobs=ref)
    SEEN.clear()
    policy_objective(inputs, torch.ones(1, 2), config, 2, 1)
    (seen,) = SEEN
    assert seen.ref_logprobs is ref and seen.rollout_logprobs is rollout and seen.teacher_logprobs is None
    assert seen.weights.tolist()[0] == pytest.approx([math.exp(0.5), 2.0])
    assert inputs.weights is None  # the caller's input is left as it was


def test_the_objective_names_a_missing_input_and_the_setting_that_needs_it():
    logp = torch.tensor([[-1.0, -2.0]])
    inputs = LossInputs(logp, logp, torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"algorithm.kl_coef=0.1 needs .*ref_logprobs"):
        policy_objective(inputs, torch.ones(1, 2), AlgorithmConfig(kl_coef=0.1), 2, 1)
    with pytest.raises(ValueError, match=r"algorithm.behavior_correction=tis .*rollout_logprobs"):
        policy_objective(inputs, torch.ones(1, 2), AlgorithmConfig(behavior_correction="tis"), 2, 1)


@pytest.mark.parametrize("name,fragments", [
    ("tests.unit.loss_plugin:nope", ["algorithm.loss.name", "no policy loss 'nope'", "scaled_pg"]),
    ("no_such_module:scaled_pg", ["algorithm.loss.name", "cannot import module 'no_such_module'"]),
    ("clipped", ["algorithm.loss.name", "set algorithm.loss.type=clipped"]),
])
def test_a_bad_custom_loss_name_says_what_to_fix(name, fragments):
    with pytest.raises(ConfigError) as error:
        build_config({"algorithm": {"loss": {"type": "custom", "name": name}}})
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))


def test_overlong_penalty_ramps_down_to_the_cap():
    from rlx.rewards.shaping import overlong_penalty

    # cap 100, buffer 20: no penalty up to 80 tokens, -0.5 at 90, -1 at 100
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 20, 1.0) == pytest.approx(-1.0)
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0


def test_gae_by_hand():
    from rlx.algorithms.values import gae

    # one sequence of 3 tokens then padding; reward 1 on the last token; V = [0.5, 0.6, 0.7]
    # gamma = 1, lam = 1: A_2 = 1 - 0.7 = 0.3 ; A_1 = (0.7 - 0.6) + 0.3 = 0.4 ; A_0 = (0.6 - 0.5) + 0.4 = 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask)
    assert adv[0].tolist() == pytest.approx([0.5, 0.4, 0.3, 0.0])
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 0.0])
    # gamma = 0.5, lam = 0.5: A_2 = 0.3 ; A_1 = (0.5*0.7 - 0.6) + 0.25*0.3 = -0.175 ; A_0 = (0.3 - 0.5) + 0.25*-0.175
    adv, _ = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert adv[0, :3].tolist() == pytest.approx([-0.24375, -0.175, 0.3])


def test_gae_skips_masked_tokens_and_carries_across_them():
    from rlx.algorithms.values import gae

    # trained tokens 0, 3 around an observation (1, 2) whose values 5, 6 and reward 9 must not enter.
    # gamma = 0.5, lam = 0.5, reward 1 on token 3, V = [0.5, 5, 6, 0.7]:
    #   A_3 = 1 - 0.7 = 0.3 ; A_0 = (0.5 * 0.7 - 0.5) + 0.25 * 0.3 = -0.075 (one discount step, not three)
    rewards = torch.tensor([[0.0, 9.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 5.0, 6.0, 0.7]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert adv[0].tolist() == pytest.approx([-0.075, 0.0, 0.0, 0.3])
    assert ret[0].tolist() == pytest.approx([0.425, 0.0, 0.0, 1.0])


def test_masked_whiten_uses_bessel_over_the_mask_by_default():
    from rlx.algorithms.values import masked_whiten

    # over the masked-in [1, 3] (the 100 is out): mean 2, squares 2; Bessel var 2 / 1, population 2 / 2
    x, mask = torch.tensor([1.0, 100.0, 3.0]), torch.tensor([1.0, 0.0, 1.0])
    out = masked_whiten(x, mask, eps=0.0)
    assert out.tolist() == pytest.approx([-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)])
    assert masked_whiten(x, mask, eps=0.0, unbiased=False).tolist() == pytest.approx([-1.0, 0.0, 1.0])


def test_clipped_value_loss_by_hand():
    from rlx.algorithms.values import clipped_value_loss

    # V = 2, V_old = 1, R = 3, clip 0.2: unclipped 0.5*(2-3)^2 = 0.5 ; clipped V' = 1.2 -> 0.5*1.8^2 = 1.62
    loss = clipped_value_loss(torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([3.0]), 0.2)
    assert loss.item() == pytest.approx(1.62)


def test_reverse_kl_advantages():
    from rlx.algorithms.distill import reverse_kl_advantages

    student, teacher = torch.tensor([[-1.0, -3.0]]), torch.tensor([[-2.0, -1.0]])
    assert reverse_kl_advantages(student, teacher).tolist() == [[-1.0, 2.0]]
    assert reverse_kl_advantages(student, teacher, torch.ones(1, 2), coef=0.5).tolist() == [[0.5, 2.0]]


def test_k1_with_a_kl_coefficient_warns_that_its_gradient_is_zero():
    from rlx.config import config_warnings

    warned = config_warnings(build_config({"algorithm": {"kl_coef": 0.05, "kl_type": "k1"}}))
    assert any("algorithm.kl_type=k1" in w and "zero in expectation" in w for w in warned), warned
    assert not any("kl_type" in w for w in config_warnings(build_config({"algorithm": {"kl_coef": 0.05}})))
    assert not any("kl_type" in w for w in config_warnings(build_config({"algorithm": {"kl_type": "k1"}})))


def test_token_normalisation_on_another_estimator_warns_it_does_nothing():
    from rlx.config import config_warnings

    warned = config_warnings(build_config({"algorithm": {"reinforce_pp_normalize": "tokens"}}))
    assert any("reinforce_pp_normalize=tokens has no effect with algorithm.advantage=grpo" in w for w in warned)
    rf = build_config({"algorithm": {"reinforce_pp_normalize": "tokens", "advantage": "reinforce_pp"}})
    assert not any("reinforce_pp_normalize" in w for w in config_warnings(rf))


def test_reinforce_pp_over_tokens_weighs_each_response_by_its_tokens():
    # rewards [0, 1] with 1 and 3 tokens: token-weighted mean 0.75, Bessel over 4 tokens:
    # var = (0.75^2 + 3 * 0.25^2) / 3 = 0.25 -> advantages (x - 0.75) / 0.5 = [-1.5, 0.5]
    out = reinforce_pp_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([0, 1]),
                                  tokens=torch.tensor([1.0, 3.0]))
    assert out.tolist() == pytest.approx([-1.5, 0.5], abs=1e-7)


def test_the_advantages_role_counts_trained_tokens_for_reinforce_pp_over_tokens():
    from rlx.data.sample import Sample
    from rlx.roles.advantages import Advantages

    samples = [Sample(uid=0, group_id=0, response_ids=[1] * 4, loss_mask=[1.0, 0.0, 0.0, 1.0], reward=0.0),
               Sample(uid=1, group_id=1, response_ids=[1] * 3, reward=1.0)]  # no loss mask: every token trained
    config = AlgorithmConfig(advantage="reinforce_pp", reinforce_pp_normalize="tokens")
    Advantages(config, filter_zero_std=False).compute(samples)
    want = reinforce_pp_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), tokens=torch.tensor([2.0, 3.0]))
    assert [s.advantage for s in samples] == pytest.approx(want.tolist())
    assert want[0] != pytest.approx(reinforce_pp_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 1]),
                                                            tokens=torch.tensor([4.0, 3.0]))[0].item())
