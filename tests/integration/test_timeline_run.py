"""`rlx timeline` on a real colocated run of the tiny model: every role's spans, properly nested."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from rlx.cli import main
from rlx.orchestration.colocate import run_colocate
from rlx.orchestration.plan import build_plan
from tests.integration.test_colocate_loop import toy_config
from tests.unit.test_timeline import assert_nested


def timeline_of(run_dir: Path) -> tuple[dict, dict[str, set[str]]]:
    """`rlx timeline RUN_DIR`'s trace (checked: well formed, nested) and the span names of each role."""
    assert main(["timeline", str(run_dir)]) == 0
    assert (run_dir / "timeline.png").stat().st_size > 10_000
    trace = json.loads((run_dir / "timeline.json").read_text())
    assert_nested(trace)
    names: dict[str, set[str]] = defaultdict(set)
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            names[event["cat"]].add(event["name"])
    return trace, names


def test_a_colocated_run_records_every_role(tiny_path, tmp_path, one_thread):
    config = toy_config(tiny_path, tmp_path, train__steps=3, rollout__prompts_per_step=2, algorithm__kl_coef=0.1)
    run_dir = run_colocate(config, echo=lambda _: None)
    trace, names = timeline_of(run_dir)
    assert set(build_plan(config).role_names) == {"rollout", "reward", "advantages", "reference", "actor"}
    assert names["rollout"] == {"start", "generate", "load_weights"}
    assert names["reward"] >= {"score"}
    assert names["advantages"] >= {"advantages"}
    assert names["reference"] >= {"forward"}
    assert names["actor"] >= {"train", "publish"}
    assert names["driver"] == {"load_data", "evaluate", "checkpoint"}  # no launch: the process is pytest's
    (process,) = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert process.startswith("colocated (")
    publishes = [e for e in trace["traceEvents"] if e["name"] == "publish"]
    assert sorted(e["args"]["version"] for e in publishes) == [1, 2, 3]
