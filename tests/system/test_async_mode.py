"""Async mode end to end: roles as Ray Serve deployments on loopback, meeting on the bus."""

from __future__ import annotations

import psutil

from rlx.obs.metrics import read_metrics
from rlx.orchestration.controller import run_async
from tests.integration.test_colocate_loop import toy_config


def test_async_run_trains_within_staleness_and_leaves_no_processes(tiny_path, tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    config = toy_config(tiny_path, tmp_path, train__steps=6, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2)
    run_dir = run_async(config, echo=lambda _: None)
    records = read_metrics(run_dir)
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert r["trained_samples"] + r.get("filtered_zero_std_group", 0) + r.get("filtered_stale", 0) == 16
        assert all(int(k.split("_")[1]) <= 1 for k in r if k.startswith("staleness_") and k != "staleness_mean")
        assert 0 < r["busy_actor"] <= 1 and 0 < r["busy_rollout"] <= 1
    assert "eval_accuracy" in records[0] and "eval_accuracy" in records[-1]
    assert (run_dir / "checkpoints" / "step_000006" / "model.safetensors").exists()
    leftover = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftover, [p.cmdline()[:3] for p in leftover]
