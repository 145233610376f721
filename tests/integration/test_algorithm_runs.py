"""Every algorithm learns: a short colocated run on the tiny model per algorithm, reward rising.

The toy task (answer with as many 'a's as possible) is learnable in a few dozen steps, so each run
checks the whole path (advantages, critic or teacher where used, loss, optimizer) moves the policy
the right way, not just that the math is right in isolation.
"""

from __future__ import annotations

import pytest
import torch

from rlx.models import load_pretrained
from rlx.models.tiny import build_tiny
from rlx.obs.metrics import read_metrics
from rlx.orchestration.colocate import run_colocate
from tests.integration.test_colocate_loop import toy_config

ALGORITHMS = {
    "grpo": {},
    "dr_grpo": {"algorithm__norm_std": False, "algorithm__aggregation": "seq-mean-token-sum",
                "algorithm__loss_horizon": 8},
    "dapo": {"algorithm__dynamic_sampling": True, "algorithm__loss": {"clip_high": 0.28}, "reward__overlong_buffer": 2,
             "reward__overlong_penalty": 0.1},
    "gspo": {"algorithm__loss": {"type": "gspo"}, "algorithm__aggregation": "seq-mean-token-mean"},
    "sapo": {"algorithm__loss": {"type": "sapo"}},
    "cispo": {"algorithm__loss": {"type": "cispo"}},
    "rloo": {"algorithm__advantage": "rloo"},
    "reinforce_pp": {"algorithm__advantage": "reinforce_pp"},
    "reinforce_pp_baseline": {"algorithm__advantage": "reinforce_pp_baseline"},
    "ppo": {"algorithm__advantage": "gae", "algorithm__lam": 0.95, "critic__lr": 3e-3},
    "grpo_kl_entropy": {"algorithm__kl_coef": 0.05, "algorithm__kl_type": "low_var",
                        "algorithm__entropy_coef": 0.001, "algorithm__loss": {"dual_clip": 3.0}},
}


def rewards_of(run_dir) -> list[float]:
    return [r["reward_mean"] for r in read_metrics(run_dir) if "reward_mean" in r]


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_each_algorithm_raises_the_reward(name, tiny_path, tmp_path):
    run_dir = run_colocate(toy_config(tiny_path, tmp_path, **ALGORITHMS[name]), echo=lambda _: None)
    rewards = rewards_of(run_dir)
    assert len(rewards) == 25
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards


def test_ppo_critic_learns_values_and_is_checkpointed(tiny_path, tmp_path):
    run_dir = run_colocate(toy_config(tiny_path, tmp_path, **ALGORITHMS["ppo"]), echo=lambda _: None)
    records = [r for r in read_metrics(run_dir) if "value_loss" in r]
    assert len(records) == 25
    # values start at 0 (zero-initialised head), then follow the rising reward (the return here)
    assert records[0]["value_mean"] == pytest.approx(0.0, abs=1e-6)
    late = records[-5:]
    assert sum(r["value_mean"] for r in late) / 5 > 0.25
    assert all(abs(r["value_mean"] - r["reward_mean"]) < 0.15 for r in late), late
    assert (run_dir / "checkpoints/step_000025/critic/model.safetensors").exists()


def test_dynamic_sampling_refills_dropped_groups(tiny_path, tmp_path):
    """Half the prompts get the same reward for every response: those groups are dropped and
    replaced, so every step still trains on prompts_per_step groups."""
    config = toy_config(tiny_path, tmp_path, algorithm__dynamic_sampling=True, algorithm__max_groups_per_step=6,
                        train__steps=3,
                        reward__name="tests.integration.toy_task:varied_on_even_prompts")
    records = [r for r in read_metrics(run_colocate(config, echo=lambda _: None)) if "trained_samples" in r]
    for record in records:
        assert record["groups_sampled"] > config.rollout.prompts_per_step
        assert record.get("filtered_zero_std_group", 0) > 0
        assert record["trained_samples"] == config.rollout.prompts_per_step * config.rollout.n


@pytest.fixture(scope="module")
def sharp_teacher(tmp_path_factory):
    """A larger tiny model (128 wide) with a sharpened output distribution: far from the student."""
    path = build_tiny(tmp_path_factory.mktemp("teacher") / "teacher", hidden=128, layers=2, heads=4, seed=7)
    model, _tokenizer = load_pretrained(path)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


def test_distillation_brings_the_student_closer_to_the_teacher(tiny_path, sharp_teacher, tmp_path):
    config = toy_config(tiny_path, tmp_path, algorithm__advantage="none", teacher__path=str(sharp_teacher),
                        train__steps=20)
    records = [r for r in read_metrics(run_colocate(config, echo=lambda _: None)) if "distill_reverse_kl" in r]
    kl = [r["distill_reverse_kl"] for r in records]
    assert len(kl) == 20
    assert sum(kl[-4:]) / 4 < 0.6 * sum(kl[:4]) / 4, kl
    assert all(r.get("filtered_zero_std_group", 0) == 0 for r in records)  # distillation teaches every group


def test_a_misbehaving_reward_fails_samples_not_the_run(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, train__steps=3, reward__timeout_s=0.3,
                        reward__name="tests.integration.toy_task:misbehaving_count_a")
    records = [r for r in read_metrics(run_colocate(config, echo=lambda _: None)) if "trained_samples" in r]
    assert len(records) == 3  # the run went on
    for record in records:
        assert record["reward_failed"] > 0
        assert record["filtered_reward_failed"] == record["reward_failed"]  # each one counted, none trained
    assert records[-1]["total_reward_failed"] == sum(r["reward_failed"] for r in records)
