"""Off-policy corrections in a real run: a colocated toy run on the tiny model with TIS trains, and
its importance weights (rollout in bfloat16, trainer in float32) stay finite and within the cap."""

from __future__ import annotations

import math

from rlx.obs.metrics import read_metrics
from rlx.orchestration.colocate import run_colocate
from tests.integration.test_colocate_loop import toy_config


def test_a_tis_run_with_a_bf16_rollout_reports_finite_losses(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, train__steps=3, rollout__dtype="bfloat16",
                        algorithm__behavior_correction="tis", algorithm__tis_cap=2.0)
    assert config.algorithm.resolved_correction == "tis"
    records = [r for r in read_metrics(run_colocate(config, echo=lambda _: None)) if "loss" in r]
    assert len(records) == 3
    for record in records:
        assert math.isfinite(record["loss"]) and math.isfinite(record["policy_loss"]), record
        # bf16 sampling against float32 training: weights near 1, never above the cap
        assert 0.5 < record["behavior_weight_mean"] <= 2.0, record
