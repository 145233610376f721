"""User environments run in killable processes of their own (rollout.agent.isolate_environment, on
by default): one that holds the GIL for ever, ends the interpreter or returns what cannot be sent
back ends only its own trajectory (each of 3 here), within rollout.agent.environment_timeout_s, and its process is
replaced; a well-behaved one plays exactly as it does in-process."""

from __future__ import annotations

import time

import psutil
import pytest

from rlx.agents.environments import user_environment
from rlx.agents.isolated import EnvironmentFailure, IsolatedEnvironments
from rlx.agents.loop import AgentRollout, TurnLimits
from rlx.data.rows import PromptRow
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.models import eos_token_ids
from tests.integration.test_agent_rollout import ENVS, _play

TIMEOUT_S = 1.0


def _rollout(tiny, factory) -> AgentRollout:
    model, tokenizer = tiny
    engine = HFGenerationEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer), tokenizer, 8)
    return AgentRollout(engine, tokenizer, factory, TurnLimits(4, 200), concurrency=6)


def _segments_text(sample, tokenizer) -> list[str]:
    """The observations (masked runs) of a trajectory, as text."""
    runs, current = [], []
    for token, mask in zip(sample.response_ids, sample.loss_mask):
        if mask == 0:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_an_isolated_environment_plays_as_it_does_in_process(tiny):
    _, tokenizer = tiny
    options = {"rounds": 2, "describe_tools": False}
    in_process = _play(_rollout(tiny, user_environment(f"{ENVS}:ScriptedTool", options)), tokenizer)
    isolated = _play(_rollout(tiny, IsolatedEnvironments(f"{ENVS}:ScriptedTool", options, TIMEOUT_S * 30, 6)),
                     tokenizer)
    assert len(isolated) == len(in_process) == 6
    # the same observations reach the policy: the environment's tool results in order, and an episode
    # the environment ends after its two results ends there (turns differ only by what was sampled)
    for samples in (in_process, isolated):
        for sample in samples:
            observed = _segments_text(sample, tokenizer)
            assert all(f"result {i + 1}" in text for i, text in enumerate(observed)), observed
        assert {s.finish_reason for s in samples} <= {"stop", "length"}
        assert all(s.agent_stats["turns"] == 3 for s in samples if s.finish_reason == "stop")
    assert any(s.finish_reason == "stop" for s in isolated)


@pytest.mark.parametrize("environment,error", [
    ("Hangs", (f"no answer within rollout.agent.environment_timeout_s={TIMEOUT_S}s; its environment process was "
              "killed")),
    ("Exits", "the environment process exited with code 3 during the call"),
    ("Garbage", "cannot be sent back"),
])
def test_a_misbehaving_environment_ends_only_its_own_trajectories(tiny, environment, error, caplog):
    _, tokenizer = tiny
    factory = IsolatedEnvironments(f"{ENVS}:{environment}", {}, TIMEOUT_S, 3)
    started = time.monotonic()
    samples = _play(_rollout(tiny, factory), tokenizer, n=1)
    assert len(samples) == 3  # every trajectory came back: the rollout went on
    failed = [s for s in samples if s.finish_reason == "env_error"]
    assert failed and {s.finish_reason for s in samples} <= {"env_error", "length"}
    assert all(error in s.metadata["env_error"] and environment in s.metadata["env_error"] for s in failed)
    if environment == "Hangs":  # killed at the deadline, not after the regex (which never ends)
        assert time.monotonic() - started < 60
    if environment != "Garbage":  # a killed or dead process is replaced; one that sent an error serves on
        assert factory.pool.replaced >= len(failed)
    pids = factory.pool.pids()
    factory.close()
    assert not {c.pid for c in psutil.Process().children() if c.status() != psutil.STATUS_ZOMBIE} & set(pids)


def test_a_user_environment_is_isolated_by_default(tmp_path):
    from rlx.agents.isolated import IsolatedEnvironment
    from rlx.agents.setup import environment_factory
    from rlx.config import build_config

    agent = {"environment": f"{ENVS}:ScriptedTool", "environment_options": {"rounds": 1}}
    config = build_config({"rollout": {"agent": agent}, "reward": {"name": "environment"}})
    factory = environment_factory(config, None)
    assert factory.pool.max_workers == config.rollout.max_batch_size  # one process per trajectory in flight
    capped = {**agent, "environment_processes": 2}
    assert environment_factory(build_config({"rollout": {"agent": capped}, "reward": {"name": "environment"}}),
                               None).pool.max_workers == 2
    env = factory()
    try:
        assert isinstance(env, IsolatedEnvironment)
        assert env.reset(PromptRow("2+2=", "4")) == [{"role": "user", "content": "2+2="}]
        assert env.step("anything").observation == [{"role": "tool", "content": "result 1"}]
    finally:
        env.close()
    env = environment_factory(build_config({"rollout": {"agent": {**agent, "isolate_environment": False}},
                                            "reward": {"name": "environment"}}), None)()
    assert type(env).__name__ == "ScriptedTool"


def test_a_reset_that_hangs_yields_samples_that_carry_the_failure(tiny):
    """The episode cannot start: its sample has the prompt, no response and the reason, which
    reward.name=environment turns into a failed reward (counted, never trained on)."""
    _, tokenizer = tiny
    factory = IsolatedEnvironments(f"{ENVS}:HangsOnReset", {}, TIMEOUT_S, 3)
    try:
        samples = _play(_rollout(tiny, factory), tokenizer, n=1)
    finally:
        factory.close()
    assert len(samples) == 3 and {s.finish_reason for s in samples} == {"env_error"}
    assert all(s.response_ids == [] and s.prompt_ids for s in samples)
    assert all("HangsOnReset reset: " in s.metadata["env_error"] and "environment_timeout_s" in s.metadata["env_error"]
               for s in samples)


def test_a_failing_reset_names_the_environment():
    env = IsolatedEnvironments(f"{ENVS}:Hangs", {}, TIMEOUT_S, 1)()
    try:
        with pytest.raises(EnvironmentFailure, match=r"^environment tests.integration.agent_envs:Hangs reset: "
                                                     r"AttributeError"):
            env.reset(None)
    finally:
        env.close()
