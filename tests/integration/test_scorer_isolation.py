"""Every scorer that reads model text runs in the killable reward pool, never in the caller's process
(review security-2026-12-05 N1, N4, N16): reasoning-gym's scorers `eval` or sympy-parse some answers,
so an answer can be code. The route is by reward name, so one task per reasoning-gym family shows it;
the countdown and n_queens answers below are code that would create a directory if it ran here."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlx.agents.environments import FeedbackEnvironment
from rlx.data.rows import PromptRow
from rlx.data.sample import Sample
from rlx.rewards import PooledReward, RewardPool, build_reward
from rlx.rewards.builtin import _gym_scorer
from rlx.rewards.pool import RewardFailure
from rlx.rewards.safe import MAX_ERROR_CHARS, score_safely
from rlx.roles import Reward

TIMEOUT_S = 1.0
SLACK_S = 4.0  # the killed worker's replacement starts (and imports rlx) within the measured call
# one task of each reasoning-gym family (its package under reasoning_gym/); composite only mixes these
FAMILIES = {"algebra": "polynomial_multiplication", "algorithmic": "binary_matrix", "arc": "arc_1d",
            "arithmetic": "basic_arithmetic", "code": "bf", "cognition": "color_cube_rotation",
            "games": "countdown", "geometry": "advanced_geometry", "graphs": "course_schedule",
            "induction": "acre", "logic": "aiw", "probability": "coin_flip"}


@pytest.fixture(scope="module")
def pool():
    with RewardPool(max_workers=1) as shared:
        yield shared


def _entry(task: str) -> dict:
    import reasoning_gym

    return next(iter(reasoning_gym.create_dataset(task, size=1, seed=0)))


def _scored(pool: RewardPool, task: str, answer: str, timeout_s: float = 60.0) -> Sample:
    """`answer` in answer tags, scored by the run's Reward role, which never builds the scorer here."""
    entry = _entry(task)
    reward = Reward(build_reward("reasoning_gym", "answer_tag"), timeout_s=timeout_s, pool=pool)
    sample = Sample(uid=0, group_id=0, response_text=f"<answer>{answer}</answer>", label=str(entry["answer"]),
                    metadata=entry["metadata"])
    _gym_scorer.cache_clear()
    reward.score([sample])
    assert _gym_scorer.cache_info().currsize == 0, "the reasoning-gym scorer was built in this process"
    assert pool.pids(), "no pool worker scored it"
    return sample


def test_every_reasoning_gym_family_has_a_task_here():
    import reasoning_gym.factory

    families = {cls.__module__.split(".")[1] for cls, _ in reasoning_gym.factory.DATASETS.values()}
    assert families - {"composite"} == set(FAMILIES)


@pytest.mark.parametrize("task", FAMILIES.values(), ids=FAMILIES.keys())
def test_each_reasoning_gym_family_is_scored_in_a_pool_process(pool, task):
    assert isinstance(build_reward("reasoning_gym", "answer_tag"), PooledReward)
    sample = _scored(pool, task, str(_entry(task)["answer"]))
    assert (sample.reward, sample.reward_error) == (1.0, None)


@pytest.mark.parametrize("task", ["countdown", "n_queens"])
def test_an_answer_that_is_code_creates_nothing(pool, tmp_path, task):
    target = tmp_path / "made-by-the-answer"
    sample = _scored(pool, task, f"__import__('os').mkdir({str(target)!r}) or 1")
    assert sample.reward < 1.0
    assert not target.exists(), "the answer ran as code with access to the host's files"


def test_a_scorer_that_hangs_on_a_huge_expression_is_stopped_at_the_deadline(tmp_path):
    with RewardPool(max_workers=1) as own:  # its worker is killed: the shared one stays warm
        _scored(own, "countdown", "1")  # warm: started, scorer built
        start = time.monotonic()
        sample = _scored(own, "countdown", "10**10**9", timeout_s=TIMEOUT_S)
        took = time.monotonic() - start
    assert sample.reward == 0.0 and f"reward.timeout_s={TIMEOUT_S}" in sample.reward_error
    assert took < TIMEOUT_S + SLACK_S


def test_a_huge_failure_message_becomes_a_short_reward_error(pool):
    reward = build_reward("tests.integration.bad_rewards:misbehaves", "none")
    outcome = score_safely(reward, "x", "y", {"fault": "raises_huge"}, 30, pool)
    assert outcome.failed and outcome.kind == "error"
    assert "RuntimeError: xxxx" in outcome.error and len(outcome.error) < MAX_ERROR_CHARS + 100


def _feedback(pool: RewardPool) -> FeedbackEnvironment:
    env = FeedbackEnvironment(build_reward("tests.integration.bad_rewards:misbehaves", "none"), timeout_s=TIMEOUT_S,
                              pool=pool)
    return env


@pytest.mark.parametrize("fault,error", [("sys_exit", "SystemExit: 3"),
                                         ("gil_regex", f"reward.timeout_s={TIMEOUT_S}")])
def test_the_feedback_environment_scores_in_the_pool_with_the_deadline(pool, fault, error):
    env = _feedback(pool)
    env.reset(PromptRow("q", "42"))
    assert env.step("it is 42").reward == 1.0
    env.reset(PromptRow("q", "42", metadata={"fault": fault}))
    start = time.monotonic()
    with pytest.raises(RewardFailure, match=error):  # the rollout ends this trajectory with env_error
        env.step("it is 42")
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S


def test_the_feedback_environment_of_a_run_gets_the_pool_and_the_deadline(tmp_path: Path):
    from rlx.agents.setup import environment_factory
    from rlx.config import build_config

    config = build_config({"model": {"path": "tiny-char"}, "data": {"source": "reasoning_gym", "task": "chain_sum"},
                           "reward": {"name": "reasoning_gym", "timeout_s": 7.0},
                           "rollout": {"agent": {"environment": "feedback"}},
                           "logging": {"run_dir": str(tmp_path)}})
    env = environment_factory(config, None)()
    assert isinstance(env, FeedbackEnvironment) and isinstance(env.pool, RewardPool) and env.timeout_s == 7.0
    env.pool.close()


def _countdown_config(tmp_path: Path):
    from rlx.config import build_config

    return build_config({"model": {"path": "tiny-char"}, "data": {"source": "reasoning_gym", "task": "countdown"},
                         "reward": {"name": "reasoning_gym", "extract": "answer_tag"},
                         "logging": {"run_dir": str(tmp_path / "run")}})


def test_the_runs_reward_role_and_trls_bench_reward_score_in_the_pool(tmp_path):
    """Colocated runs, the Reward service and the driver's evaluator all score with
    build_reward_role's Reward; `rlx bench trl` hands TRL that same role."""
    from rlx.bench.trl import trl_reward

    entry = _entry("countdown")
    row = PromptRow(entry["question"], str(entry["answer"]), metadata=entry["metadata"])
    target = tmp_path / "made-by-the-answer"
    answer, right = f"<answer>__import__('os').mkdir({str(target)!r}) or 1</answer>", f"<answer>{entry['answer']}</answer>"
    reward = trl_reward([row], _countdown_config(tmp_path))
    _gym_scorer.cache_clear()
    scores = reward([[{"content": answer}], [{"content": right}]], [0, 0])
    assert scores[0] < 1.0 and scores[1] == 1.0
    assert _gym_scorer.cache_info().currsize == 0, "the scorer was built in this process"
    assert not target.exists()


def _evaluating_scorers() -> set[str]:
    """reasoning-gym tasks whose score_answer runs text as Python (eval, sympy's parse_expr, sympify)."""
    import inspect
    import re

    from reasoning_gym.factory import DATASETS

    found = set()
    for task, (dataset, _) in DATASETS.items():
        source = inspect.getsource(dataset.score_answer)
        if re.search(r"\b(eval|exec|parse_expr|sympify|S)\s*\(", source):
            found.add(task)
    return found


def test_every_reasoning_gym_scorer_that_evaluates_text_is_guarded():
    """A tripwire for new reasoning-gym releases: a scorer that starts evaluating its answer must be
    listed, or this fails (the list reads this version's sources)."""
    from rlx.rewards.builtin import EVALUATING_TASKS

    assert _evaluating_scorers() <= EVALUATING_TASKS
    assert {"countdown", "puzzle24", "n_queens", "polynomial_multiplication"} <= _evaluating_scorers()


@pytest.mark.parametrize("task", sorted(__import__("rlx.rewards.builtin", fromlist=["x"]).EVALUATING_TASKS))
def test_an_evaluating_scorer_never_runs_the_answer_even_in_process(task, tmp_path):
    """Confinement keeps code off the host, not off the reward: run here, in-process and unconfined,
    a code answer would create the directory (and could set its own score, review of 2026-12-06).
    The true answer still scores 1.0 and an answer that only tampers scores what no answer scores."""
    score = build_reward("reasoning_gym", "answer_tag").fn  # the function itself, in this process
    entry = _entry(task)
    made = tmp_path / "made"
    code = f"<answer>__import__('os').mkdir({str(made)!r}) or 1</answer>"
    assert score(f"<answer>{entry['answer']}</answer>", entry["answer"], entry["metadata"]) == 1.0
    assert score(code, entry["answer"], entry["metadata"]) == _gym_scorer(task)(None, entry)
    assert not made.exists()
    forged = "<answer>[x for x in ().__class__.__base__.__subclasses__()]</answer>"
    assert score(forged, entry["answer"], entry["metadata"]) < 1.0
