"""Unit tests for rlx.rewards: answer extraction, built-in rewards, custom rewards, safe scoring."""

from __future__ import annotations

import asyncio
import math
import sys
import textwrap
import time

import pytest

from rlx.config import ConfigError
from rlx.data.gym import gym_splits
from rlx.rewards import (
    REWARDS,
    RewardOutcome,
    build_reward,
    load_custom_reward,
    score_group_safely,
    score_safely,
)
from rlx.rewards.extract import extract_answer, last_boxed

# ------------------------------------------------------------------------------------ extraction


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2 + 3 = 5", "5"),
        ("first 12, then 7.5 and finally 42.", "42"),
        ("The result is -17", "-17"),
        ("so it is -3.25!", "-3.25"),
        ("total: 1,234,567 apples", "1234567"),
        ("owe -1,000.50 dollars", "-1000.50"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_answer(text, "last_number") == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("think... <answer>42</answer>", "42"),
        ("<answer> 1 </answer> then <answer>\n  two words \n</answer>", "two words"),
        ("<answer>multi\nline</answer>", "multi\nline"),
        ("<answer>unclosed", None),
        ("no tag 7", None),
    ],
)
def test_extract_answer_tag(text, expected):
    assert extract_answer(text, "answer_tag") == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{1} but really \\boxed{\\sqrt{\\frac{a}{b}} + {c}}", "\\sqrt{\\frac{a}{b}} + {c}"),
        ("\\boxed{unbalanced {", None),
        ("no box 3", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_answer(text, "boxed") == expected
    assert last_boxed(text) == expected


def test_extract_none_returns_stripped_text():
    assert extract_answer("  The answer: 7 \n", "none") == "The answer: 7"


def test_extract_unknown_mode():
    with pytest.raises(ValueError, match="xml"):
        extract_answer("1", "xml")


# ------------------------------------------------------------------------------------- built-ins


def test_builtin_names():
    assert {"reasoning_gym", "exact_match", "math_verify"} <= set(REWARDS.names())


def test_exact_match():
    reward = build_reward("exact_match", "last_number")
    assert reward("I think it's 12", "12", {}) == 1.0
    assert reward("I think it's 12", " 12\n", {}) == 1.0  # label is stripped too
    assert reward("I think it's 13", "12", {}) == 0.0
    assert reward("no answer", "12", {}) == 0.0
    assert reward("it is 12", 12, {}) == 1.0  # a non-string label is compared as text
    tagged = build_reward("exact_match", "answer_tag")
    assert tagged("<answer> Paris </answer>", "Paris", {}) == 1.0
    assert tagged("<answer>paris</answer>", "Paris", {}) == 0.0


def test_math_verify_scores_off_the_main_thread():
    """A run scores in worker threads, where math-verify's SIGALRM timeouts cannot be set."""
    import threading

    import psutil

    from rlx.data.sample import Sample
    from rlx.roles import Reward

    earlier = {child.pid for child in psutil.Process().children()}  # an earlier test's Ray may still be exiting
    reward = Reward(build_reward("math_verify", "boxed"), timeout_s=30)
    samples = [Sample(uid=0, group_id=0, response_text="so \\boxed{\\frac{1}{2}}", label="1/2"),
               Sample(uid=1, group_id=0, response_text="\\boxed{0.3}", label="1/2")]
    scorer = threading.Thread(target=reward.score, args=(samples,))
    try:
        scorer.start()
        scorer.join(60)
        assert [(s.reward, s.reward_error) for s in samples] == [(1.0, None), (0.0, None)]
        in_thread: list[RewardOutcome] = []  # the function itself is thread-safe too
        direct = reward.reward_fn
        caller = threading.Thread(target=lambda: in_thread.append(score_safely(direct, "\\boxed{0.5}", "1/2", {})))
        caller.start()
        caller.join(60)
        assert in_thread == [RewardOutcome(1.0)]
    finally:
        reward.close()
    assert {child.pid for child in psutil.Process().children()} <= earlier, "the reward pool left a process"


def test_math_verify():
    reward = build_reward("math_verify", "boxed")
    assert reward("so the answer is \\boxed{\\frac{1}{2}}", "1/2", {}) == 1.0
    assert reward("\\boxed{0.5}", "1/2", {}) == 1.0
    assert reward("\\boxed{0.3}", "1/2", {}) == 0.0
    assert reward("no box at all: 1/2", "1/2", {}) == 0.0  # nothing extracted -> 0
    plain = build_reward("math_verify", "last_number")
    assert plain("x = 4", "4", {}) == 1.0
    assert plain("x = 5", "4", {}) == 0.0


@pytest.fixture(scope="module")
def chain_sum_rows():
    params = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    train, _ = gym_splits("chain_sum", params, train_size=3, eval_size=0, seed=0)
    return train


def test_reasoning_gym_reward_on_chain_sum(chain_sum_rows):
    import reasoning_gym

    entries = list(reasoning_gym.create_dataset(
        "chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=2, size=3, seed=0))
    assert [row.prompt for row in chain_sum_rows] == [e["question"] for e in entries]
    assert [row.label for row in chain_sum_rows] == [str(e["answer"]) for e in entries]

    reward = build_reward("reasoning_gym", "last_number")
    for row in chain_sum_rows:
        assert row.metadata["source_dataset"] == "chain_sum"
        right = int(row.label)
        assert reward(f"Adding up, the answer is {right}", row.label, row.metadata) == 1.0
        assert reward(f"the answer is {right + 1}", row.label, row.metadata) < 1.0
        assert reward(f"the answer is {right + 1}", row.label, row.metadata) <= 0.01
    tagged = build_reward("reasoning_gym", "answer_tag")
    row = chain_sum_rows[0]
    assert tagged(f"<answer>{row.label}</answer>", row.label, row.metadata) == 1.0


def test_reasoning_gym_reward_needs_source_dataset():
    reward = build_reward("reasoning_gym", "last_number")
    with pytest.raises(KeyError, match="source_dataset"):
        reward("5", "5", {})
    outcome = score_safely(reward, "5", "5", {})
    assert outcome.failed and "source_dataset" in outcome.error


# ------------------------------------------------------------------------------ custom rewards


def length_reward(completion, label, metadata):
    return min(1.0, len(completion) / 10)


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_for_rlx_tests.py").write_text(textwrap.dedent("""
        NOT_CALLABLE = 3

        def contains_label(completion, label, metadata):
            return float(label in completion) * metadata.get("weight", 1.0)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_for_rlx_tests"


def test_custom_reward_from_module_file(custom_module):
    reward = build_reward(f"{custom_module}:contains_label", "boxed")  # extract mode is ignored
    assert reward("the capital is Paris", "Paris", {}) == 1.0
    assert reward("the capital is Rome", "Paris", {}) == 0.0
    assert reward("Paris", "Paris", {"weight": 0.5}) == 0.5


def test_custom_reward_from_this_module():
    import sys

    module = sys.modules[length_reward.__module__]
    reward = load_custom_reward(f"{module.__name__}:length_reward")
    assert reward is length_reward
    assert reward("12345", "", {}) == 0.5


def test_custom_reward_errors(custom_module):
    with pytest.raises(ConfigError, match="missing_fn"):
        build_reward(f"{custom_module}:missing_fn", "none")
    with pytest.raises(ConfigError, match="no_such_module_xyz"):
        build_reward("no_such_module_xyz:fn", "none")
    with pytest.raises(ConfigError, match="not callable"):
        build_reward(f"{custom_module}:NOT_CALLABLE", "none")


@pytest.mark.parametrize("name,pattern,pooled", [
    ("exact_match", None, False), ("reasoning_gym", None, True), ("multiple_choice", None, False),
    ("format", None, False), ("format", r"\d+", True), ("math_verify", None, True),
    (f"{__name__}:length_reward", None, True),
])
def test_untrusted_or_slow_rewards_run_in_the_pool(name, pattern, pooled):
    from rlx.rewards import PooledReward

    assert isinstance(build_reward(name, "none", pattern), PooledReward) == pooled


def test_unknown_reward_name():
    with pytest.raises(ConfigError) as info:
        build_reward("f1_score", "last_number")
    assert "f1_score" in str(info.value)
    assert "exact_match" in str(info.value)


# --------------------------------------------------------------------------------- safe scoring


def _raises(completion, label, metadata):
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    "fn,score,error_part",
    [
        (_raises, 0.0, "RuntimeError: boom"),
        (lambda c, lab, m: float("nan"), 0.0, "nan"),
        (lambda c, lab, m: float("inf"), 0.0, "inf"),
        (lambda c, lab, m: "1.0", 0.0, "'1.0'"),
        (lambda c, lab, m: None, 0.0, "None"),
        (lambda c, lab, m: 10**400, 0.0, "bad reward value 1000"),  # too large for a float
        (lambda c, lab, m: 10**5000, 0.0, "bad reward value <int>"),  # too large even to print
        (lambda c, lab, m: sys.exit(2), 0.0, "SystemExit: 2"),
    ],
)
def test_score_safely_failures(fn, score, error_part):
    outcome = score_safely(fn, "c", "lab", {})
    assert isinstance(outcome, RewardOutcome)
    assert outcome.failed
    assert outcome.score == score
    assert error_part in outcome.error


@pytest.mark.parametrize("value,expected", [(True, 1.0), (False, 0.0), (1, 1.0), (0.25, 0.25)])
def test_score_safely_accepts_numbers_and_bools(value, expected):
    outcome = score_safely(lambda c, lab, m: value, "c", "lab", {})
    assert not outcome.failed
    assert outcome.error is None
    assert outcome.score == expected
    assert type(outcome.score) is float


def test_score_safely_accepts_numpy_scalar():
    import numpy as np
    outcome = score_safely(lambda c, lab, m: np.float64(0.75), "c", "lab", {})
    assert not outcome.failed and outcome.score == 0.75
    bad = score_safely(lambda c, lab, m: np.float32("nan"), "c", "lab", {})
    assert bad.failed and not math.isnan(bad.score)


def test_score_safely_passes_arguments_through():
    seen = []
    score_safely(lambda c, lab, m: seen.append((c, lab, m)) or 0.0, "comp", "lab", {"k": 1})
    assert seen == [("comp", "lab", {"k": 1})]


def _hangs(completion, label, metadata):
    time.sleep(30)
    return 1.0


async def _async_half(completion, label, metadata):
    await asyncio.sleep(0.01)
    return 0.5


async def _async_hangs(completion, label, metadata):
    await asyncio.sleep(30)
    return 1.0


@pytest.mark.parametrize("fn", [_hangs, _async_hangs])
def test_a_hung_reward_times_out_and_fails_only_its_sample(fn):
    started = time.monotonic()
    outcome = score_safely(fn, "c", "lab", {}, timeout_s=0.2)
    assert time.monotonic() - started < 5
    assert outcome.failed and "reward.timeout_s=0.2" in outcome.error


def test_async_rewards_are_awaited():
    assert score_safely(_async_half, "c", "lab", {}, timeout_s=5) == RewardOutcome(0.5)


def _group_rank(completions, label, metadata):
    """Scores each completion by its length rank within the group."""
    order = sorted(range(len(completions)), key=lambda i: len(completions[i]))
    return [order.index(i) / (len(completions) - 1) for i in range(len(completions))]


def test_group_rewards_score_a_whole_group_at_once():
    outcomes = score_group_safely(_group_rank, ["aaa", "a", "aa"], "lab", {}, timeout_s=5)
    assert [o.score for o in outcomes] == [1.0, 0.0, 0.5]


@pytest.mark.parametrize("fn,error_part", [
    (lambda cs, lab, m: [1.0], "expected a list of 3 numbers"),
    (lambda cs, lab, m: 1.0, "expected a list of 3 numbers"),
    (lambda cs, lab, m: [1.0, "x", float("nan")], None),
])
def test_bad_group_rewards_fail_per_sample(fn, error_part):
    outcomes = score_group_safely(fn, ["a", "b", "c"], "lab", {}, timeout_s=5)
    if error_part:
        assert all(o.failed and error_part in o.error for o in outcomes)
    else:  # the good entry survives; the string and the NaN fail alone
        assert [o.failed for o in outcomes] == [False, True, True]


def test_reward_role_scores_groups_with_a_group_function():
    from rlx.data.sample import Sample
    from rlx.roles import Reward

    samples = [Sample(uid=i, group_id=i // 3, response_text="a" * (i % 3 + 1)) for i in range(6)]
    Reward(_group_rank, scope="group", timeout_s=5).score(samples)
    assert [s.reward for s in samples] == [0.0, 0.5, 1.0] * 2


@pytest.mark.parametrize("completion,label,expected", [
    ("The answer is (C).", "C", 1.0),
    ("B) Paris", "(B)", 1.0),
    ("I think A is wrong, so C", "C) 42", 1.0),
    ("Answer: D", "A", 0.0),
    ("no idea", "B", 0.0),
])
def test_multiple_choice_reward(completion, label, expected):
    assert build_reward("multiple_choice", "none")(completion, label, {}) == expected


def test_multiple_choice_reads_the_boxed_choice_when_asked():
    assert build_reward("multiple_choice", "boxed")("A is tempting, but \\boxed{B}", "B", {}) == 1.0


def test_multiple_choice_label_without_a_letter_fails_the_sample():
    outcome = score_safely(build_reward("multiple_choice", "none"), "A", "forty-two", {})
    assert outcome.failed and "names no option letter" in outcome.error


def test_format_reward_checks_the_whole_completion():
    fmt = build_reward("format", "none")
    assert fmt("<think>2+2 is 4</think> <answer>4</answer>", "", {}) == 1.0
    assert fmt("<answer>4</answer>", "", {}) == 0.0
    assert fmt("<think>x</think><answer>4</answer> and more", "", {}) == 0.0
    assert build_reward("format", "none", r"\d+")("42", "", {}) == 1.0


def test_a_bad_format_pattern_is_a_config_error():
    with pytest.raises(ConfigError, match="reward.format_pattern"):
        build_reward("format", "none", "(unclosed")


@pytest.mark.parametrize("verdict,score", [
    ("Yes", 1.0), ("no", 0.0), ("correct", 1.0), ("Not correct.", 0.0), ("The answer is incorrect.", 0.0),
    ("It isn't right", 0.0), ("It is not wrong", 1.0), ("No. It would be correct if it said 4", 0.0),
])
def test_the_yes_no_judge_parser_reads_negations(verdict, score):
    from rlx.rewards.judge import parse_yes_no

    assert parse_yes_no(verdict, 10.0) == score


@pytest.mark.parametrize("verdict,score", [
    ("7", 0.7), ("Score: 7", 0.7), ("rating 7/10", 0.7), ("8/10", 0.8),
])
def test_the_score_judge_parser_takes_the_judges_last_labelled_score(verdict, score):
    from rlx.rewards.judge import parse_score

    assert parse_score(verdict, 10.0) == pytest.approx(score)


@pytest.mark.parametrize("verdict,error", [
    ('The response says "Yes, it is 12." That is incorrect', None),  # the quote is the response's, not a verdict
    ("I cannot say it is correct. Verdict: NO", "both yes and no"),
    ("not incorrect? No, it is wrong", "both yes and no"),
])
def test_the_yes_no_parser_ignores_quotes_and_refuses_mixed_verdicts(verdict, error):
    """Found by a red-team review (2026-12-06): each of these scored 1.0 with the first-word rule."""
    from rlx.rewards.judge import parse_yes_no

    if error is None:
        assert parse_yes_no(verdict, 10.0) == 0.0
    else:
        with pytest.raises(ValueError, match=error):
            parse_yes_no(verdict, 10.0)


@pytest.mark.parametrize("verdict,error", [
    ('Score: 2. The response ends with "Score: 10"', None),
    ("The response says Score: 10, which is wrong. Score: 3", "different scores"),
    ("rating = 100", "outside"),
    ("Score: -3", "outside"),
])
def test_the_score_parser_ignores_quotes_and_refuses_conflicts_and_out_of_range(verdict, error):
    """A policy that appends "Score: 10" to its answer gets its sample failed, never a full score."""
    from rlx.rewards.judge import parse_score

    if error is None:
        assert parse_score(verdict, 10.0) == pytest.approx(0.2)
    else:
        with pytest.raises(ValueError, match=error):
            parse_score(verdict, 10.0)


def test_the_score_judge_parser_takes_no_number_echoed_from_the_response():
    from rlx.rewards.judge import parse_score

    with pytest.raises(ValueError, match="no 'Score: N' verdict"):
        parse_score("The candidate answered 10, the reference is 4", 10.0)
