"""`rlx timeline` on a real async run of the tiny model: spans from every role's replica process."""

from __future__ import annotations

import pytest

from rlx.orchestration.async_run import run_async
from tests.integration.test_colocate_loop import toy_config
from tests.integration.test_timeline_run import timeline_of


@pytest.mark.slow  # an async run: about a minute here
def test_an_async_run_records_spans_in_every_replica(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, train__steps=2, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2)
    run_dir = run_async(config, echo=lambda _: None)
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
    assert publishes == [1, 2]
