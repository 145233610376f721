"""Multi-turn training runs end to end on the tiny model, in colocated and in async mode."""

from __future__ import annotations

import pytest
import torch

from rlx.models.tiny import char_tokenizer
from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from rlx.orchestration.colocate import run_colocate
from tests.integration.test_colocate_loop import toy_config

AGENT = {"environment": "tests.integration.agent_envs:ScriptedTool", "environment_options": {"rounds": 1},
         "max_turns": 3, "max_trajectory_tokens": 40,
         "concurrency": 4}  # each trajectory in flight holds an environment process: few, on 2 cores


def _agent_config(tiny_path, tmp_path, **overrides):
    # a random tiny model rarely writes <eos>: frequent characters end its turns instead
    stops = char_tokenizer().convert_tokens_to_ids(list("aeiou0123456789"))
    return toy_config(tiny_path, tmp_path, train__steps=3, rollout__agent=AGENT, rollout__stop_token_ids=stops,
                      rollout__prompts_per_step=2, train__eval_every=0,
                      reward__name="tests.integration.toy_task:varied_on_even_prompts", **overrides)


# async mode: `tests/integration/test_bench_agentic.py` runs multi-turn tool trajectories in an async
# run (the Rollout's Serve replica, its environments in processes of their own); this one passed
# there too (49 s) and is left out to keep the suite's time down
@pytest.mark.parametrize("mode", ["colocate"])
def test_a_multi_turn_run_trains_on_policy_tokens_only(tiny_path, tmp_path, mode):
    if mode == "colocate":
        run_dir = run_colocate(_agent_config(tiny_path, tmp_path), echo=lambda _: None)
    else:
        config = _agent_config(tiny_path, tmp_path, train__mode="async", train__max_staleness=1)
        run_dir = run_async(config, echo=lambda _: None)
    steps = [r for r in read_metrics(run_dir) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        assert 1.0 <= record["agent_turns_mean"] <= 2.0  # one tool round at most
        assert 0.0 < record["agent_masked_token_fraction"] < 1.0
        assert record.get("agent_tool_lookup_ok", 0.0) > 0
    assert sum(r["trained_samples"] for r in steps) > 0 and all("loss" in r for r in steps if r["trained_samples"])


@pytest.mark.parametrize("mode", ["colocate"])  # async too: 63 s, passed (`-k agent_app` with "async" added)
def test_an_agent_app_run_trains_on_every_call_its_episodes_made(tiny_path, tmp_path, mode):
    config = toy_config(tiny_path, tmp_path, train__steps=2, rollout__prompts_per_step=4, rollout__n=4,
                        rollout__agent_app="tests.integration.agent_apps:toy_chat", reward__name="environment",
                        train__eval_every=0, train__mode=mode, train__max_staleness=1)
    run_dir = (run_colocate if mode == "colocate" else run_async)(config, echo=lambda _: None)
    steps = [r for r in read_metrics(run_dir) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        # each episode made 3 calls: a side call that continues nothing is a sample of its own; the
        # chat's second call continues the first where its prompt extends that call token for token,
        # else it is a sample too (a tiny-char turn that ended in <eos> does not: its template
        # writes no <eos>, so the re-sent history differs from the tokens)
        assert 2.0 <= record["agent_samples_per_episode"] <= 3.0
        rows = sum(v for k, v in record.items() if k.startswith("staleness_") and k[10:].isdigit())
        assert record["trained_samples"] <= rows - record["reward_failed"]
        if mode == "colocate":  # a step is its 16 episodes, every call of them
            assert rows == pytest.approx(16 * record["agent_samples_per_episode"])
            assert record["agent_turns_mean"] * rows == pytest.approx(16 * 3)
        assert 0.0 < record["agent_masked_token_fraction"] < 1.0
    # the app fails on odd-numbered prompts (all their episodes, and only theirs); no response
    # reached the trainer twice (a step counts an episode's samples in shares of one response)
    assert steps[-1]["total_samples_duplicated"] == 0
    assert sum(r["reward_failed"] for r in steps) > 0 and sum(r["trained_samples"] for r in steps) > 0


def test_a_ppo_multi_turn_run_skips_observation_tokens_in_gae(tiny_path, tmp_path, monkeypatch):
    """PPO (a critic, GAE with lambda < 1) on tool trajectories. Advantages.compute is wrapped to keep the
    samples it scored (the real computation runs unchanged): observation tokens get advantage and
    return 0, and the whitening is over trained tokens only (their advantages have mean 0 and Bessel std 1)."""
    from rlx.roles.advantages import Advantages

    scored_steps: list[list] = []
    compute = Advantages.compute

    def keep_scored(self, samples):
        result = compute(self, samples)
        scored_steps.append([s for s in samples if s.filter_reason != "reward_failed"])
        return result

    monkeypatch.setattr(Advantages, "compute", keep_scored)
    config = _agent_config(tiny_path, tmp_path, algorithm__advantage="gae", algorithm__lam=0.9,
                           algorithm__gamma=0.99, rollout__n=2, critic__lr=1e-3)
    run_dir = run_colocate(config, echo=lambda _: None)
    steps = [r for r in read_metrics(run_dir) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all("value_loss" in r for r in steps if r["trained_samples"])
    holes = 0
    for samples in scored_steps:
        trained = []
        for s in samples:
            mask = s.loss_mask or [1.0] * len(s.response_ids)
            runs = [m for i, m in enumerate(mask) if i == 0 or m != mask[i - 1]]
            holes += "1.0,0.0,1.0" in ",".join(map(str, runs))
            assert all(a == 0.0 and r == 0.0 for a, r, m in zip(s.token_advantages, s.returns, mask) if m == 0.0)
            trained += [a for a, m in zip(s.token_advantages, mask) if m == 1.0]
        values = torch.tensor(trained, dtype=torch.float64)
        assert abs(values.mean().item()) < 1e-5 and values.std().item() == pytest.approx(1.0, abs=1e-4)
    assert holes > 0, "some trajectory had an observation between two policy turns"
