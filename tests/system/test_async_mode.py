"""Async mode end to end: roles as Ray Serve deployments on loopback, meeting on the bus, each
replica recording its spans for `rlx timeline`."""

from __future__ import annotations

import json

import psutil

from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from tests.integration.test_colocate_loop import toy_config
from tests.integration.test_timeline_run import timeline_of


def test_async_run_trains_within_staleness_and_leaves_no_processes(tiny_path, tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # the autoscaler's thresholds here call for another engine whatever the back-pressure (its policy
    # has unit tests): this run checks the operation end to end, and that its replica leaves no process
    autoscale = {"enabled": True, "max_replicas": 2, "window_s": 2, "scale_up_below": 2.0, "scale_down_above": 3.0}
    config = toy_config(tiny_path, tmp_path, train__steps=6, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2, rollout__autoscale=autoscale)
    run_dir = run_async(config, echo=lambda _: None)
    records = read_metrics(run_dir)
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert r["trained_samples"] + r.get("filtered_zero_std_group", 0) + r.get("filtered_stale", 0) == 16
        # a group finishing out of order can come back staler than admission allowed: the trainer
        # drops every such sample (as stale, unless its group was already dropped for equal rewards),
        # so none past max_staleness=1 is trained on
        too_stale = sum(v for k, v in r.items() if k.startswith("staleness_") and k != "staleness_mean"
                        and int(k.split("_")[1]) > 1)
        assert too_stale <= r.get("filtered_stale", 0) + r.get("filtered_zero_std_group", 0)
        assert 0 <= r["busy_actor"] <= 1 and 0 <= r["busy_rollout"] <= 1
    # heartbeats lag the steps by a second or two: a loaded machine can report a step before any beat
    # that counts its work, so each role must be busy over the run, not at every step
    assert max(r["busy_actor"] for r in steps) > 0 and max(r["busy_rollout"] for r in steps) > 0
    assert "eval_accuracy" in records[0] and "eval_accuracy" in records[-1]
    assert records[-1]["eval_weight_version"] == 6  # the driver evaluated the trained weights
    assert (run_dir / "checkpoints" / "step_000006" / "model.safetensors").exists()
    (scaled,) = json.loads((run_dir / "health.json").read_text())["scaling"]
    assert scaled["replicas_before"] == 1 and scaled["replicas"] == 2 and scaled["reason"].startswith("autoscaler")
    leftover = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftover, [p.cmdline()[:3] for p in leftover]
    assert_every_replica_recorded_spans(run_dir, versions=list(range(1, 7)))


def assert_every_replica_recorded_spans(run_dir, versions: list[int]) -> None:
    """`rlx timeline` of the run: spans from the driver and from each role's replica process."""
    trace, _ = timeline_of(run_dir)
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    by_process: dict[str, set[tuple[str, str]]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            label = processes[event["pid"]].split(" (")[0]
            by_process.setdefault(label.split("-")[0], set()).add((event["cat"], event["name"]))
    # the driver, and one process per role: its replica; every role waited for its first rows
    assert set(by_process) == {"driver", "rollout", "reward", "advantages", "actor_fwd", "actor"}
    assert {("rollout", "generate"), ("rollout", "load_weights")} <= by_process["rollout"]
    assert {("reward", "score"), ("reward", "wait")} <= by_process["reward"]
    assert {("advantages", "advantages"), ("advantages", "wait")} <= by_process["advantages"]
    assert {("actor_fwd", "forward"), ("actor_fwd", "load_weights")} <= by_process["actor_fwd"]
    assert {("actor", "train"), ("actor", "publish"), ("actor", "wait"), ("actor", "checkpoint")} <= by_process["actor"]
    assert {("driver", "evaluate"), ("driver", "start"), ("rollout", "load_weights")} <= by_process["driver"]
    for role in ("rollout", "reward", "advantages", "actor_fwd", "actor"):  # building the role, loading weights
        assert (role, "start") in by_process[role], role
    publishes = sorted(e["args"]["version"] for e in trace["traceEvents"] if e["name"] == "publish")
    assert publishes == versions


def test_async_ppo_with_teacher_and_judge_roles(tiny_path, tmp_path):
    """Critic, Teacher, Reference and GenRM each run as their own service: values, teacher and
    reference log-probs and judged rewards all travel over the bus, and the critic's training steps
    reach the metrics. Weights go to the rollout and to the reference (reset to the policy every
    step) over a gloo broadcast group."""
    config = toy_config(tiny_path, tmp_path, train__steps=3, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2, algorithm__advantage="gae", teacher__path=str(tiny_path),
                        reward__name="genrm", weights__channel="gloo", algorithm__kl_coef=0.1,
                        algorithm__kl_reference_refresh_every=1)
    config.reward.judge.model = str(tiny_path)
    config.reward.judge.parser = "tests.integration.toy_task:judge_length"
    run_dir = run_async(config, echo=lambda _: None)
    steps = [r for r in read_metrics(run_dir) if "reward_mean" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["reward_failed"] == 0 and r["reward_mean"] > 0  # the judge's verdicts
        assert "distill_reverse_kl" in r  # teacher log-probs reached the trainer
        assert r["proximal_staleness_mean"] >= 0  # ActorFwd's versions reached the trainer
        assert 0 < r["busy_critic"] <= 1 and 0 < r["busy_teacher"] <= 1 and 0 < r["busy_genrm"] <= 1
    assert sum("value_loss" in r for r in steps) >= 2  # critic steps, reported beside the actor's
    weights = json.loads((run_dir / "health.json").read_text())["weights"]
    # released as the rollout moved on: the latest, and at most the one the rollout was still using
    assert weights["latest"] == 3 and weights["epoch"] >= 1 and weights["held"][-1] == 3 and len(weights["held"]) <= 2
    # max_staleness=1 makes the default correction decoupled PPO: ActorFwd follows the policy too
    assert sorted(name.split("-")[0] for name in weights["subscribers"]) == ["actor_fwd", "reference", "rollout"]
    assert {s["channel"] for s in weights["subscribers"].values()} == {"gloo"}
    assert all("kl" in r for r in steps)
