"""HealthManager bookkeeping, in-process: a silent replica's work goes back, nothing is lost.

The heartbeat board, bus and prompt source are the real classes, used in-process; silence is
simulated by moving a replica's last beat into the past (standing in for a dead process)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from rlx.bus import LocalBus
from rlx.config import RunConfig
from rlx.data.rows import PromptRow
from rlx.data.stream import PromptStream
from rlx.orchestration.health import HealthManager, RoleFailed
from rlx.orchestration.heartbeats import Heartbeats
from rlx.orchestration.plan import build_plan
from rlx.orchestration.prompt_source import PromptSource
from rlx.orchestration.reports import StepReports
from rlx.orchestration.staleness import StalenessGate

N = 2  # responses per prompt


def setup(global_recovery: frozenset[str] = frozenset()):
    bus, beats = LocalBus(), Heartbeats()
    prompts = PromptSource(PromptStream([PromptRow(f"q{i}", "a") for i in range(10)], seed=0), StalenessGate(0, 2))
    plan = build_plan(RunConfig(algorithm={"kl_coef": 0.1}))  # a Reference too: a role with replicas
    health = HealthManager(plan, bus, prompts, beats, group_size=N, dead_after_s=5, max_restarts_per_role=1,
                           max_restarts=5, global_recovery=global_recovery)
    return bus, beats, prompts, health


def go_silent(beats: Heartbeats, replica: str) -> None:
    beats.replicas[replica]["last"] -= 60


def put_group(bus, group_id: int, rows: int) -> list[int]:
    return bus.put({"x": [0] * rows}, group_ids=[group_id] * rows)


def test_a_dead_rewarders_unfinished_rows_go_back_and_finished_ones_stay():
    bus, beats, _, health = setup()
    rows = put_group(bus, 0, N) + put_group(bus, 1, N)
    dying = bus.for_consumer("reward-a")
    taken, _ = dying.get("reward", ["x"], 4)
    bus.put_fields(taken[:2], {"reward": [1.0, 0.0]})  # finished two of the four before dying
    beats.beat("reward", "reward-a", {"busy_fraction": 0.5})
    assert health.observe() == []
    go_silent(beats, "reward-a")
    [recovery] = health.observe()
    assert (recovery.role, recovery.rows_released) == ("reward", 2)
    again, _ = bus.get("reward", ["x"], 4, timeout=0, partial=True)
    assert again == rows[2:]  # only the unfinished rows are handed out again
    assert "reward-a" not in beats.snapshot()


def test_a_dead_rollouts_partial_groups_are_dropped_and_handed_out_again():
    bus, beats, prompts, health = setup()
    issued = prompts.take(3, "rollout-a", version=0)
    assert [g for g, _ in issued] == [0, 1]  # the staleness gate allows two groups at version 0
    put_group(bus, 0, N)  # group 0 complete (its "finished" note died with the replica)
    put_group(bus, 1, 1)  # group 1 half done
    beats.beat("rollout", "rollout-a", {"busy_fraction": 1.0})
    health.observe()
    go_silent(beats, "rollout-a")
    [recovery] = health.observe()
    assert recovery.groups_requeued == 1
    # group 1's row is gone, and its count with it: made again, it is counted from nothing
    assert sorted(bus.index.rows_per_group) == [0] and len(bus.index.rows) == N
    assert prompts.take(1, "rollout-b") == [issued[1]]  # the same prompt, first in line


def test_a_role_with_another_replica_up_is_never_down():
    """Two Reference replicas: losing one leaves the role serving (its gap is 0). A role's only
    replica leaves a gap until its replacement beats, even if that replacement is up before the
    death is noticed."""
    _, beats, _, health = setup()
    for replica, role in [("ref-a", "reference"), ("ref-b", "reference"), ("reward-a", "reward")]:
        beats.beat(role, replica, {"busy_fraction": 0.5})
    health.observe()
    for dead in ("ref-a", "reward-a"):
        health.fault_injected(health.known[dead][0])
        go_silent(beats, dead)
    beats.beat("reward", "reward-b", {"busy_fraction": 0.5})  # the replacement, up before the death is noticed
    recoveries = {r.role: r for r in health.observe()}
    assert recoveries["reference"].others_serving == 1 and recoveries["reward"].others_serving == 0
    report = {r["role"]: r for r in health.report()}
    assert report["reference"]["role_down_s"] == 0.0
    assert report["reward"]["role_down_s"] == report["reward"]["replaced_after_s"] is not None


def test_stateful_roles_and_restart_limits_stop_the_run_with_a_reason():
    _bus, beats, _, health = setup()
    beats.beat("advantages", "adv-a", {})
    beats.beat("advantages", "adv-b", {})
    health.observe()
    go_silent(beats, "adv-a")
    health.observe()
    go_silent(beats, "adv-b")
    with pytest.raises(RoleFailed, match="max_restarts_per_role=1"):
        health.observe()
    _bus, beats, _, health = setup()
    beats.beat("actor", "actor-a", {})
    health.observe()
    go_silent(beats, "actor-a")
    with pytest.raises(RoleFailed, match="--resume"):
        health.observe()


def test_a_trainer_that_raised_recovers_globally_until_its_limit_then_the_run_stops_naming_it():
    """An exception in the Actor's loop (an out-of-memory error: its heartbeat carries it) is a
    death like a lost process: a global recovery, counted against train.max_restarts_per_role (1
    here). A beat still in flight from the failed replica is no second death. Past the limit the
    run stops, naming the role and the error."""
    bus, beats, _, health = setup(global_recovery=frozenset({"actor", "critic"}))
    oom = "RuntimeError: CUDA out of memory. Tried to allocate 20.00 GiB"
    put_group(bus, 0, 1)
    [taken], _ = bus.for_consumer("actor-a").get("train", ["x"], 1, timeout=0)  # held mid-step
    beats.beat("actor", "actor-a", {"busy_fraction": 1.0, "error": oom})
    [recovery] = health.observe()
    assert (recovery.role, recovery.scope, recovery.rows_released) == ("actor", "global", 1)
    assert bus.get("train", ["x"], 1, timeout=0)[0] == [taken]  # the row it held goes back
    beats.beat("actor", "actor-a", {"busy_fraction": 1.0, "error": oom})  # sent before it was killed
    beats.beat("actor", "actor-b", {"busy_fraction": 1.0})  # the replacement, from the checkpoint
    assert health.observe() == [] and list(health.live) == ["actor-b"]
    beats.beat("actor", "actor-b", {"busy_fraction": 1.0, "error": oom})
    with pytest.raises(RoleFailed, match=r"role 'actor' was replaced 2 times .*max_restarts_per_role=1.*"
                                         r"its worker failed: RuntimeError: CUDA out of memory"):
        health.observe()


def test_the_api_thread_reads_replicas_while_the_driver_observes():
    """L5: the management API's thread reads `live`, `known` and the recoveries (`status`,
    `engines`) while the driver's loop observes beats. The reader must never see a dict change
    under it (before, `observe` refilled `live` in place: "dictionary changed size during iteration")."""
    _, beats, _, health = setup()
    for i in range(2000):
        beats.beat("reference", f"ref-{i}", {"busy_fraction": 0.5})
    errors: list[BaseException] = []
    done = threading.Event()

    def api_reads() -> None:
        while not done.is_set():
            try:
                [beat["status"] for beat in health.live.values()]  # AsyncRun.status
                health.replicas("reference"), health.busy(), health.report()
            except BaseException as error:  # noqa: BLE001 - the test reports whatever the reader hit
                errors.append(error)
                return

    reader = threading.Thread(target=api_reads)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race shows at once
    try:
        reader.start()
        for round_ in range(30):
            beats.beat("reward", f"reward-{round_}", {"busy_fraction": 0.5})  # `known` grows too
            health.observe()
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert errors == []
    assert len(health.live) == 2030


def test_a_replica_that_said_goodbye_is_not_a_failure():
    _bus, beats, _, health = setup()
    beats.beat("rollout", "rollout-a", {"stopped": True, "failure": None})
    assert health.observe() == [] and health.recoveries == []
    assert beats.snapshot() == {}


def test_step_reports_survive_a_lost_reply_and_a_replacement():
    """A trainer keeps each step's report until the driver's cursor shows it arrived: a reply lost
    to a timeout comes again, and a replacement trainer's reports are never taken for seen ones."""
    reports = StepReports()
    for step in (1, 2, 3):
        reports.add({"trainer_step": float(step)})
    first = reports.after(None)
    assert [m["trainer_step"] for _, m in first] == [1, 2, 3]
    reports.add({"trainer_step": 4.0})
    reports.after(first[-1][0])  # its reply never reaches the driver, whose cursor stays
    assert [m["trainer_step"] for _, m in reports.after(first[-1][0])] == [4]  # step 4 comes again
    replacement = StepReports()
    replacement.add({"trainer_step": 3.0})
    assert [m["trainer_step"] for _, m in replacement.after(first[-1][0])] == [3]
    assert reports.drain() == [{"trainer_step": 4.0}] and reports.drain() == []


def test_services_without_a_model_never_import_transformers():
    """A replacement Reward or Advantages replica is back as soon as its process has imported what
    it needs; transformers alone costs seconds, so only the services that load a model import it."""
    probe = ("import sys\n"
             "from rlx.config import RunConfig\n"
             "from rlx.orchestration.services import build_advantages, build_reward_role\n"
             "build_reward_role(RunConfig()), build_advantages(RunConfig())\n"
             "print(sorted(m for m in ('transformers', 'reasoning_gym') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
