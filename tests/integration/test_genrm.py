"""GenRM: a judge model on its own generation engine writes the rewards."""

from __future__ import annotations

import pytest

from rlx.bus import LocalBus
from rlx.engines.generation.base import GenerationRequest
from rlx.obs.metrics import read_metrics
from rlx.orchestration.builder import build_components, build_genrm, build_workers
from rlx.orchestration.colocate import run_colocate
from rlx.orchestration.plan import FIELDS
from tests.integration.test_colocate_loop import toy_config
from tests.integration.toy_task import judge_length

# A tiny random judge cannot judge; the test parser (verdict length) makes its verdicts graded numbers,
# so the test can recompute each reward from the judge's own greedy output.
JUDGE = {"reward__name": "genrm"}


def judge_config(tiny_path, tmp_path, **overrides):
    config = toy_config(tiny_path, tmp_path, **JUDGE, **overrides)
    config.reward.judge.model = str(tiny_path)
    config.reward.judge.parser = "tests.integration.toy_task:judge_length"
    config.reward.judge.max_score = 8.0
    return config


def test_rewards_are_the_judges_verdicts(tiny_path, tmp_path):
    config = judge_config(tiny_path, tmp_path)
    c = build_components(config)
    bus = LocalBus(check_schema=FIELDS)
    with build_workers(c, bus, sync_weights=lambda: None, publish=c.sync_weights, max_staleness=0) as workers:
        workers.rollout.generate(2)
        workers.reward.drain()
        rows, values = bus.get("check", ["response_text", "prompt_text", "label", "reward", "reward_error"], 16)
        judge = build_genrm(config)  # an independent copy of the judge: greedy, so it must agree
        from rlx.data.sample import Sample

        for i in range(len(rows)):
            sample = Sample(uid=i, group_id=0, prompt_text=values["prompt_text"][i],
                            response_text=values["response_text"][i], label=values["label"][i])
            result = judge.engine.generate([GenerationRequest(0, judge.judge_prompt(sample))], judge.params)[0]
            verdict = judge.tokenizer.decode(result.response_ids, skip_special_tokens=True)
            assert values["reward_error"][i] is None
            assert values["reward"][i] == pytest.approx(judge_length(verdict, 8.0))
            assert values["prompt_text"][i].startswith("say a ")  # the judge sees the user's question


def test_a_run_whose_reward_comes_from_the_judge(tiny_path, tmp_path):
    records = read_metrics(run_colocate(judge_config(tiny_path, tmp_path, train__steps=3), echo=lambda _: None))
    steps = [r for r in records if "reward_mean" in r]
    assert len(steps) == 3
    assert all(r["reward_failed"] == 0 and 0 < r["reward_mean"] <= 1 for r in steps)


def test_an_unparseable_verdict_fails_its_sample(tiny_path, tmp_path):
    config = judge_config(tiny_path, tmp_path)
    config.reward.judge.parser = "yes_no"  # a random judge says neither
    judge = build_genrm(config)
    from rlx.data.sample import Sample

    samples = judge.score([Sample(uid=0, group_id=0, prompt_text="q", response_text="r", label="l")])
    assert samples[0].reward_error.startswith("GenRM: ValueError: judge said neither yes nor no")


@pytest.mark.parametrize("parser,kind,error", [
    ("judge_raises", "error", "GenRM: TypeError: the parser is broken"),
    ("judge_nan", "bad_value", "GenRM: bad reward value nan"),
    ("judge_too_high", "bad_value", "GenRM: the parser returned 2.0; a judge score is in [0, 1]"),
])
def test_a_custom_parser_that_fails_or_returns_a_bad_value_fails_its_sample(tiny_path, tmp_path, parser, kind, error):
    config = judge_config(tiny_path, tmp_path)
    config.reward.judge.parser = f"tests.integration.bad_rewards:{parser}"
    judge = build_genrm(config)
    from rlx.data.sample import Sample

    try:
        samples = judge.score([Sample(uid=0, group_id=0, prompt_text="q", response_text="r", label="l")])
    finally:
        judge.close()
    assert samples[0].reward == 0.0 and samples[0].reward_error.startswith(error)
    assert judge.failures == {kind: 1}


def test_the_judges_generation_has_a_deadline(tiny_path, tmp_path):
    config = judge_config(tiny_path, tmp_path)
    config.reward.judge.max_new_tokens = 64
    judge = build_genrm(config)
    judge.timeout_s = 1e-6  # past after the first decode step
    from rlx.data.sample import Sample

    samples = judge.score([Sample(uid=i, group_id=0, prompt_text="q", response_text="r" * i, label="l")
                           for i in range(4)])
    late = [s for s in samples if s.reward_error is not None]
    assert late and all("reward.judge.timeout_s=1e-06s" in s.reward_error for s in late)
    assert judge.failures == {"timeout": len(late)}
