"""Async mode end to end: roles as Ray Serve deployments on loopback, meeting on the bus, each
replica recording its spans for `rlx timeline`."""

from __future__ import annotations

import json

import psutil
import pytest

from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from tests.integration.test_colocate_loop import toy_config
from tests.integration.test_timeline_run import timeline_of


def test_an_async_ppo_run_with_every_role_trains_within_staleness_scales_and_leaves_no_processes(tiny_path,
                                                                                                tmp_path):
    """Every role as its own service in one run: the Critic (PPO), the Teacher, the Reference (reset
    to the policy every step), GenRM's judge and ActorFwd (decoupled PPO) beside the Rollout and the
    Actor. Values, teacher and reference log-probs and judged rewards all travel over the bus; the
    weights reach the rollout, the reference and ActorFwd over a gloo broadcast group; the
    autoscaler adds an engine; each replica records its spans; nothing is left running."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # the autoscaler's thresholds here call for another engine whatever the back-pressure (its policy
    # has unit tests): this run checks the operation end to end, and that its replica leaves no process
    autoscale = {"enabled": True, "max_replicas": 2, "window_s": 2, "scale_up_below": 2.0, "scale_down_above": 3.0}
    config = toy_config(tiny_path, tmp_path, train__steps=5, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2, rollout__autoscale=autoscale, algorithm__advantage="gae",
                        teacher__path=str(tiny_path), reward__name="genrm", weights__channel="gloo",
                        algorithm__kl_coef=0.1, algorithm__kl_reference_refresh_every=1)
    config.reward.judge.model = str(tiny_path)
    config.reward.judge.parser = "tests.integration.toy_task:judge_length"
    run_dir = run_async(config, echo=lambda _: None)
    records = read_metrics(run_dir)
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps:
        assert r["trained_samples"] + sum(v for k, v in r.items() if k.startswith("filtered_")) == 16
        # a group finishing out of order can come back staler than admission allowed: the trainer
        # drops every such sample (as stale, unless its group was already dropped for equal rewards),
        # so none past max_staleness=1 is trained on
        too_stale = sum(v for k, v in r.items() if k.startswith("staleness_") and k != "staleness_mean"
                        and int(k.split("_")[1]) > 1)
        assert too_stale <= r.get("filtered_stale", 0) + r.get("filtered_zero_std_group", 0)
        assert r["reward_failed"] == 0 and r["reward_mean"] > 0  # the judge's verdicts
        assert "distill_reverse_kl" in r and "kl" in r  # teacher and reference log-probs reached the trainer
        assert r["proximal_staleness_mean"] >= 0  # ActorFwd's versions reached the trainer
        for role in ("actor", "rollout", "critic", "teacher", "genrm"):
            assert 0 <= r[f"busy_{role}"] <= 1
    # heartbeats lag the steps by a second or two: a loaded machine can report a step before any beat
    # that counts its work, so each role must be busy over the run, not at every step
    for role in ("actor", "rollout", "critic", "teacher", "genrm"):
        assert max(r[f"busy_{role}"] for r in steps) > 0, role
    assert sum("value_loss" in r for r in steps) >= 2  # critic steps, reported beside the actor's
    assert "eval_accuracy" in records[0] and "eval_accuracy" in records[-1]
    assert records[-1]["eval_weight_version"] == 5  # the driver evaluated the trained weights
    assert (run_dir / "checkpoints" / "step_000005" / "model.safetensors").exists()
    health = json.loads((run_dir / "health.json").read_text())
    (scaled,) = health["scaling"]
    assert scaled["replicas_before"] == 1 and scaled["replicas"] == 2 and scaled["reason"].startswith("autoscaler")
    weights = health["weights"]
    # released as the engines moved on: the latest, and at most the one an engine was still using
    assert weights["latest"] == 5 and weights["epoch"] >= 1 and weights["held"][-1] == 5 and len(weights["held"]) <= 2
    # max_staleness=1 makes the default correction decoupled PPO: ActorFwd follows the policy too
    assert {name.split("-")[0] for name in weights["subscribers"]} == {"actor_fwd", "reference", "rollout"}
    assert {s["channel"] for s in weights["subscribers"].values()} == {"gloo"}
    leftover = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftover, [p.cmdline()[:3] for p in leftover]
    assert_every_replica_recorded_spans(run_dir, versions=list(range(1, 6)),
                                        others=("critic", "teacher", "reference"), scorer="genrm")


def assert_every_replica_recorded_spans(run_dir, versions: list[int], others: tuple[str, ...] = (),
                                        scorer: str = "reward") -> None:
    """`rlx timeline` of the run: spans from the driver and from each role's replica process
    (`scorer`: the role that scores, reward or genrm; `others`: roles beyond the core ones)."""
    trace, _ = timeline_of(run_dir)
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    by_process: dict[str, set[tuple[str, str]]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            label = processes[event["pid"]].split(" (")[0]
            by_process.setdefault(label.split("-")[0], set()).add((event["cat"], event["name"]))
    # the driver, and one process per role: its replica; every role waited for its first rows
    core = ("rollout", scorer, "advantages", "actor_fwd", "actor")
    assert set(by_process) == {"driver", *core, *others}
    assert {("rollout", "generate"), ("rollout", "load_weights")} <= by_process["rollout"]
    assert {("reward", "score"), ("reward", "wait")} <= by_process[scorer]
    assert {("advantages", "advantages"), ("advantages", "wait")} <= by_process["advantages"]
    assert {("actor_fwd", "forward"), ("actor_fwd", "load_weights")} <= by_process["actor_fwd"]
    assert {("actor", "train"), ("actor", "publish"), ("actor", "wait"), ("actor", "checkpoint")} <= by_process["actor"]
    assert {("driver", "evaluate"), ("driver", "start"), ("rollout", "load_weights")} <= by_process["driver"]
    for role in (*core, *others):  # building the role, loading weights
        assert any(name == "start" for _, name in by_process[role]), role
    publishes = sorted(e["args"]["version"] for e in trace["traceEvents"] if e["name"] == "publish")
    assert publishes == versions


@pytest.mark.slow  # a Ray cluster and a Serve deployment per role: about a minute here
def test_async_media_travel_the_ray_bus_once_per_group(tiny_vision_path, tmp_path):
    """Image RL (tests/system/test_vision_runs.py) in async mode: each group's images on the Ray bus once."""
    from tests.system.test_vision_runs import digits_config  # skips without scikit-learn's digits

    config = digits_config(tiny_vision_path, tmp_path, mode="async", max_staleness=0, steps=2, eval_every=0)
    run_dir = run_async(config, echo=lambda _: None)
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    assert steps and all(r["rollout_logprob_abs_diff"] < 1e-4 for r in steps)


@pytest.mark.slow  # loads the real SmolLM2 model in every role's replica
def test_an_async_smollm2_run_records_every_role(tmp_path):
    """The trace of a real async run (SmolLM2 on chain_sum, every role its own Serve replica): each
    role's replica recorded spans, nested within each thread (`rlx timeline`)."""
    from rlx.config import build_config

    config = build_config({
        "model": {"path": "smollm2-135m-instruct"},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "train_size": 200, "eval_size": 16,
                 "task_params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}},
        "rollout": {"n": 4, "prompts_per_step": 2, "max_new_tokens": 16, "temperature": 1.0},
        "reward": {"name": "reasoning_gym", "extract": "last_number"},
        "train": {"mode": "async", "max_staleness": 1, "steps": 2, "micro_batch_size": 8, "eval_every": 0},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False},
    })
    run_dir = run_async(config, echo=lambda _: None)
    assert_every_replica_recorded_spans(run_dir, versions=[1, 2])


def test_async_moe_routes_reach_every_trainer_role_and_survive_a_resume(tmp_path):
    """R3 (tests/system/test_moe_runs.py) in async mode: the routes travel over the bus to the Actor,
    ActorFwd and Reference services, through a checkpoint and a resume."""
    from rlx.models.tiny import build_tiny
    from rlx.orchestration.run_dir import latest_checkpoint
    from rlx.run_state import load_run_state

    moe_path = build_tiny(tmp_path / "tiny-moe", moe_family="qwen3_moe")
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
