"""Fault injection's schedule: checked against the run's roles, each fault fired once at its step."""

from __future__ import annotations

import time

import pytest

from rlx.config import ConfigError, build_config
from rlx.orchestration.faults import INJECTED_ERROR, DriverFaults, StepFaults
from rlx.orchestration.plan import build_plan


def faults_of(*faults):
    config = build_config({"train": {"mode": "async"}, "faults": list(faults)})
    return DriverFaults(config, build_plan(config))


def test_a_fault_for_a_role_the_run_lacks_names_the_roles_it_has():
    with pytest.raises(ConfigError, match="'critic' is not part of this run; its roles are actor, reward, "
                                          "advantages, rollout, dcs, bus, prompts, heartbeats"):
        faults_of({"role": "critic", "at_step": 1})


@pytest.mark.parametrize("fault, message", [
    ({"role": "bus", "at_step": 1, "kind": "hang"}, "bus takes kind kill, not 'hang'"),
    ({"role": "dcs", "at_step": 1, "kind": "raise"}, "dcs takes kind kill or hang, not 'raise'"),
])
def test_a_fault_a_target_cannot_take_is_named(fault, message):
    with pytest.raises(ConfigError, match=message):
        faults_of(fault)


def test_driver_fires_each_fault_once_its_step_is_reached():
    faults = faults_of({"role": "reward", "at_step": 2}, {"role": "dcs", "at_step": 1, "kind": "hang"},
                       {"role": "actor", "at_step": 1}, {"role": "prompts", "at_step": 4})
    calls, injected = [], []
    fire = lambda step: faults.fire_due(step, lambda *a: calls.append(a), lambda kind: calls.append(("dcs", kind)),
                                        injected.append, echo=lambda _: None,
                                        kill_shared=lambda name: calls.append(("ray.kill", name)))
    fire(1)
    assert calls == [("dcs", "hang")] and injected == ["dcs"]
    fire(3)
    fire(4)
    assert calls == [("dcs", "hang"), ("reward", "inject_fault", "kill"), ("ray.kill", "prompts")]
    assert injected == ["dcs", "reward", "prompts"]
    armed = []
    faults.arm_actor(lambda *a: armed.append(a))  # the Actor fires its own, at its own step
    assert armed == [("actor", "schedule_fault", "kill", 1)]


def test_step_faults_fire_at_or_after_their_step_and_only_once():
    fired, faults = [], StepFaults()
    faults.schedule(3, lambda: fired.append("a"))
    faults.after_step(2)
    assert fired == []
    faults.after_step(5)  # a step can be skipped (a restored trainer): a due fault still fires
    faults.after_step(6)
    assert fired == ["a"]


def test_a_raise_fault_makes_the_worker_loop_fail_with_an_out_of_memory_error():
    """`raise` (injected): the worker's own loop raises, as an out-of-memory error in the role would;
    the error is what the replica's heartbeat and health check report."""
    from rlx.orchestration.faults import inject
    from rlx.orchestration.workers import Worker

    class Idle(Worker):
        def work_once(self) -> int:
            time.sleep(0.01)
            return 0

    worker = Idle("critic")
    worker.run_forever()
    inject("raise", worker)
    worker._thread.join(timeout=10)
    assert not worker._thread.is_alive()
    assert worker.status()["error"] == f"RuntimeError: {INJECTED_ERROR}"
