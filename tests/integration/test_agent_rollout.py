"""Multi-turn rollouts token in and token out: the trainer scores exactly the engine's tokens, with
the engine's log-probs, and observations never reach the loss."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlx.agents.environments import user_environment
from rlx.agents.loop import AgentRollout, TurnLimits
from rlx.algorithms.losses import LossInputs
from rlx.algorithms.objective import policy_objective
from rlx.config import AlgorithmConfig
from rlx.data.rows import PromptRow
from rlx.engines.generation.base import SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.engines.training import token_logprobs
from rlx.models import eos_token_ids
from rlx.orchestration.reports import agent_metrics
from rlx.roles.batching import samples_to_batch

ENVS = "tests.integration.agent_envs"
ROWS = [PromptRow("12+7=", "19"), PromptRow("what is 3-9?", "-6"), PromptRow("x", "x")]


def _rollout(tiny, environment: str = "ScriptedTool", options: dict | None = None, max_turns: int = 4,
             max_tokens: int = 200) -> AgentRollout:
    model, tokenizer = tiny
    engine = HFGenerationEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer), tokenizer, 8)
    factory = user_environment(f"{ENVS}:{environment}", options or {})
    return AgentRollout(engine, tokenizer, factory, TurnLimits(max_turns, max_tokens), concurrency=6)


def _params(tokenizer, max_new_tokens: int = 12) -> SamplingParams:
    """A random tiny model rarely writes <eos>: frequent characters end its turns instead."""
    stops = tuple(tokenizer.convert_tokens_to_ids(list("aeiou0123456789")))
    return SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=stops, seed=3)


def _play(rollout: AgentRollout, tokenizer, n: int = 2, **params) -> list:
    groups = [(i, row, []) for i, row in enumerate(ROWS)]
    return list(rollout.generate(groups, n, _params(tokenizer, **params)))


def _segments(sample) -> list[tuple[float, list[int]]]:
    """(mask value, tokens) runs along the response."""
    runs: list[tuple[float, list[int]]] = []
    for token, mask in zip(sample.response_ids, sample.loss_mask):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    return runs


def test_observations_are_masked_and_tokenised_once_between_policy_turns(tiny):
    rollout = _rollout(tiny)
    samples = _play(rollout, tiny[1])
    assert len(samples) == 6 and len({s.uid for s in samples}) == 6
    finished = [s for s in samples if s.finish_reason == "stop"]
    assert finished, "some trajectory ran all its tool rounds"
    for sample in finished:
        runs = _segments(sample)
        assert [mask for mask, _ in runs] == [1.0, 0.0, 1.0, 0.0, 1.0]
        observations = [tiny[1].decode(ids) for mask, ids in runs if mask == 0.0]
        # the tiny template: the turn's closing newline, the tool message, the next assistant header
        assert observations == ["\n<t>result 1\n<a>", "\n<t>result 2\n<a>"]
        assert sample.agent_stats["turns"] == 3 and sample.metadata["env_reward"] == 1.0
        assert len(sample.rollout_logprobs) == len(sample.response_ids) == len(sample.loss_mask)
        assert sample.response_text == tiny[1].decode(runs[-1][1], skip_special_tokens=True)


def test_the_trainer_scores_the_engines_tokens_with_the_engines_logprobs(tiny):
    model, tokenizer = tiny
    samples = _play(_rollout(tiny), tokenizer)
    batch = samples_to_batch(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        trained, _ = token_logprobs(model, batch, 1.0)
    policy_tokens = 0
    for row, sample in enumerate(samples):
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        gap = (trained[row, : len(sample.response_ids)][mask] - torch.tensor(sample.rollout_logprobs)[mask]).abs()
        assert gap.max().item() < 1e-4
        policy_tokens += int(mask.sum())
    assert policy_tokens > len(samples)  # several policy turns were checked, not one token each


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_no_gradient_reaches_a_masked_token(tiny, kl_coef):
    model, tokenizer = tiny
    samples = _play(_rollout(tiny), tokenizer)
    for i, sample in enumerate(samples):
        sample.advantage = 1.0 if i % 2 else -1.0
        sample.ref_logprobs = [lp - 0.1 for lp in sample.rollout_logprobs]
    config = AlgorithmConfig(kl_coef=kl_coef, entropy_coef=0.01)
    batch = samples_to_batch(samples, tokenizer.pad_token_id, {
        "advantages": [[s.advantage] * len(s.response_ids) for s in samples],
        "rollout_logprobs": [s.rollout_logprobs for s in samples],
        "ref_logprobs": [s.ref_logprobs for s in samples]})
    logprobs, entropy = token_logprobs(model, batch, 1.0, with_entropy=True)
    logprobs.retain_grad()
    entropy.retain_grad()
    inputs = LossInputs(logprobs, logprobs.detach(), batch.per_token["advantages"], batch.response_mask,
                        rollout_logprobs=batch.per_token["rollout_logprobs"],
                        ref_logprobs=batch.per_token["ref_logprobs"])
    loss, _ = policy_objective(inputs, entropy, config, 1.0, 1.0)
    loss.backward()
    masked = batch.response_mask == 0
    assert logprobs.grad[masked].abs().max().item() == 0.0 and entropy.grad[masked].abs().max().item() == 0.0
    assert logprobs.grad[~masked].abs().max().item() > 0.0


def test_limits_end_trajectories_and_are_counted(tiny):
    cut_by_turns = _play(_rollout(tiny, options={"rounds": 10}, max_turns=2), tiny[1])
    stopped = [s for s in cut_by_turns if s.finish_reason != "length"]
    assert stopped and all(s.finish_reason == "max_turns" and s.agent_stats["turns"] == 2 for s in stopped)
    cut_by_tokens = _play(_rollout(tiny, options={"rounds": 10}, max_turns=10, max_tokens=30), tiny[1])
    assert all(len(s.response_ids) <= 30 for s in cut_by_tokens)
    assert {s.finish_reason for s in cut_by_tokens} <= {"max_tokens", "length"}
    metrics = agent_metrics(cut_by_tokens)
    assert metrics["agent_cut_fraction"] == 1.0 and 0.0 < metrics["agent_masked_token_fraction"] < 1.0


def test_an_environment_that_raises_ends_only_its_trajectory(tiny):
    samples = _play(_rollout(tiny, environment="Broken"), tiny[1])
    assert len(samples) == 6
    assert {s.finish_reason for s in samples} <= {"env_error", "length"}
    assert any(s.finish_reason == "env_error" for s in samples)


def test_an_environment_step_that_raises_system_exit_ends_only_its_trajectory(tiny):
    samples = _play(_rollout(tiny, environment="SysExits"), tiny[1])
    failed = [s for s in samples if s.finish_reason == "env_error"]
    assert len(samples) == 6 and failed
    assert all(s.metadata["env_error"] == "SystemExit: 4" for s in failed)


def test_tools_of_different_trajectories_run_while_other_turns_decode(tiny):
    """A step is called when a policy turn finished decoding: one starting while another trajectory's
    tool runs means that turn decoded while the other trajectory waited out of the batch."""
    from tests.integration.agent_envs import SlowTool

    SlowTool.calls.clear()
    samples = _play(_rollout(tiny, environment="SlowTool", options={"rounds": 2, "seconds": 0.3}), tiny[1])
    assert len(samples) == 6 and any(s.agent_stats["turns"] == 3 for s in samples)
    calls = sorted(SlowTool.calls)
    assert any(a_start < b_start < a_end for (a_start, a_end), (b_start, _) in itertools.pairwise(calls))


def test_held_out_evaluation_plays_whole_trajectories(tiny):
    from rlx.orchestration.evaluation import evaluate
    from rlx.rewards import build_reward
    from rlx.roles import Reward

    reward = Reward(build_reward("environment", "none"))
    metrics = evaluate(_rollout(tiny, options={"rounds": 1}), reward, ROWS, lambda row: [], _params(tiny[1]))
    assert metrics["eval_agent_turns_mean"] > 1.0 and metrics["eval_agent_masked_token_fraction"] > 0.0
    assert metrics["eval_reward_failed"] + 3 * metrics["eval_accuracy"] == 3  # env reward 1.0 unless cut
