"""R3 runs end to end on a tiny Qwen3-MoE: colocated, and async with the routes travelling over
the bus to the Actor, ActorFwd and Reference services, through a checkpoint and a resume."""

from __future__ import annotations

import pytest

from rlx.models.tiny import build_tiny
from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from rlx.orchestration.colocate import run_colocate
from rlx.orchestration.run_dir import latest_checkpoint
from rlx.run_state import load_run_state
from tests.integration.test_colocate_loop import toy_config


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("models") / "tiny-moe", moe_family="qwen3_moe")


def test_a_colocated_moe_run_replays_routes_by_default(moe_path, tmp_path):
    config = toy_config(moe_path, tmp_path, train__steps=3, rollout__dtype="bfloat16",
                        algorithm__routing_mismatch_every=2)
    assert config.routing_replay == "r3"  # auto: a MoE model on the hf engine
    run_dir = run_colocate(config, echo=lambda _: None)
    assert "routing_replay resolved to r3" in (run_dir / "config.yaml").read_text()
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    assert len(steps) == 3
    assert all(0 <= r["route_mismatch_fraction"] <= 1 and r["rollout_logprob_abs_diff"] >= 0 for r in steps)
    # the unreplayed forward runs on the steps routing_mismatch_every picks (versions 0 and 2)
    assert ["rollout_logprob_abs_diff_unreplayed" in r for r in steps] == [True, False, True]


def test_async_routes_reach_every_trainer_role_and_survive_a_resume(moe_path, tmp_path):
    config = toy_config(moe_path, tmp_path, train__steps=2, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2, train__checkpoint_every=1, algorithm__kl_coef=0.1,
                        algorithm__routing_replay="r3")
    assert config.algorithm.resolved_correction == "decoupled"  # ActorFwd runs, and replays too
    run_dir = run_async(config, echo=lambda _: None)
    rows = load_run_state(latest_checkpoint(run_dir))["bus"]["rows"]
    stored = [row[3]["routed_experts"] for row in rows if "routed_experts" in row[3]]
    assert stored, "no row on the bus at the checkpoint carried its routes"
    assert all(r.dtype.is_floating_point is False and r.shape[1:] == (2, 2) for r in stored)

    resumed = run_async(config.model_copy(update={"train": config.train.model_copy(update={"steps": 4})}),
                        resume=True, echo=lambda _: None)
    steps = [r for r in read_metrics(resumed) if "reward_mean" in r]
    assert [int(r["step"]) for r in steps] == [1, 2, 3, 4]
    trained = [r for r in steps if "loss" in r]  # a step whose groups all had equal rewards trains on nothing
    assert trained and all("route_mismatch_fraction" in r and "kl" in r for r in trained)
