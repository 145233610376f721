"""R3 runs end to end on a tiny Qwen3-MoE, colocated (beside the one-at-a-time tests); the async run,
routes travelling over the bus to the Actor, ActorFwd and Reference services through a checkpoint
and a resume, is in test_async_mode.py."""

from __future__ import annotations

import pytest

from rlx.models.tiny import build_tiny
from rlx.obs.metrics import read_metrics
from rlx.orchestration.colocate import run_colocate
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

