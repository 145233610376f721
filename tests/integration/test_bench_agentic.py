"""`rlx bench agentic` on tiny work: the bench environment's tool calls are real and take their
latency, the busy probe's arithmetic, and a colocate-vs-async run that fills the table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlx.bench.agentic import BusyProbe, CpuShare, ToolTurns, Work, format_table, run_agentic_benchmark
from rlx.data.rows import PromptRow


def test_each_turn_but_the_last_is_a_real_calculator_call_that_takes_its_latency():
    env = ToolTurns(tool_calls=2, tool_latency_s=0.05)
    assert env.reset(PromptRow("Add 123 and 456.", "579", {"expression": "123+456"})) == [
        {"role": "user", "content": "Add 123 and 456."}]
    for _ in range(2):
        step = env.step("anything the policy wrote")
        assert not step.done and step.observation == [{"role": "tool", "content": "579"}]
        [call] = step.tool_calls
        assert call.tool == "calculator" and call.outcome == "ok" and call.latency_s >= 0.05
    assert env.step("the answer").done
    env.close()


def test_the_probe_measures_busy_seconds_over_the_replicas_own_elapsed_time(tmp_path):
    probe = BusyProbe(tmp_path)
    # (driver step, role -> (busy seconds, elapsed seconds)); step 0 is start-up, step 4 the end
    probe.samples = [(0, {"actor": (1.0, 9.0)}), (1, {"actor": (2.0, 10.0)}), (2, {"rollout": (5.0, 12.0)}),
                     (3, {"actor": (7.4, 16.0)}), (4, {"actor": (7.5, 20.0)})]
    assert probe.busy("actor", 1, 4) == pytest.approx(0.9)
    with pytest.raises(RuntimeError, match="too little"):
        probe.busy("rollout", 1, 4)


def test_cpu_share_counts_a_process_that_started_and_ended_during_the_mode():
    burn = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end:\n    pass"
    with CpuShare(every_s=0.1) as cpu:
        subprocess.run([sys.executable, "-c", burn], check=True)
    assert cpu.own_cores > 0.05 and cpu.other_cores >= 0.0


def test_colocate_and_async_on_the_same_multi_turn_work_fill_the_table(tmp_path):
    work = Work(prompts_per_step=2, n=4, tool_calls=2, tool_latency_s=1.0, concurrency=8, hidden=32, layers=1,
                actor_threads=1)
    results = run_agentic_benchmark(tmp_path, steps=4, work=work, modes=(("colocate", 0), ("async", 2)))
    assert [r["mode"] for r in results] == ["colocate", "async, max_staleness=2"]
    for row in results:
        assert row["samples_per_s"] > 0 and row["step_s"] > 0
        assert 0.0 <= row["busy_actor"] <= 1.0 and 0.0 <= row["busy_rollout"] <= 1.0
        assert row["agent_turns_mean"] == 3.0 and row["agent_tool_calls_mean"] == 2.0
        assert row["agent_tool_latency_mean_s"] >= 1.0 and row["agent_cut_fraction"] == 0.0
        assert row["own_cores"] > 0.0 and row["other_cores"] >= 0.0
    assert results[0]["speedup"] == 1.0
    table = format_table(results, work)
    assert "| colocate | " in table and "| async, max_staleness=2 | " in table and "Bound:" in table
    assert "3 policy turns and 2 calculator calls of 1 s wall time" in table
