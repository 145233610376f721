"""Fault injection's schedule: checked against the run's roles, each fault fired once at its step."""

from __future__ import annotations

import pytest

from rlx.config import ConfigError, build_config
from rlx.orchestration.faults import DriverFaults, StepFaults
from rlx.orchestration.plan import build_plan


def faults_of(*faults):
    config = build_config({"train": {"mode": "async"}, "faults": list(faults)})
    return DriverFaults(config, build_plan(config))


def test_a_fault_for_a_role_the_run_lacks_names_the_roles_it_has():
    with pytest.raises(ConfigError, match="'critic' is not part of this run; its roles are actor, reward, "
                                          "advantages, rollout, dcs"):
        faults_of({"role": "critic", "at_step": 1})


def test_driver_fires_each_fault_once_its_step_is_reached():
    faults = faults_of({"role": "reward", "at_step": 2}, {"role": "dcs", "at_step": 1, "kind": "hang"},
                       {"role": "actor", "at_step": 1})
    calls, injected = [], []
    fire = lambda step: faults.fire_due(step, lambda *a: calls.append(a), lambda kind: calls.append(("dcs", kind)),
                                        injected.append, echo=lambda _: None)
    fire(1)
    assert calls == [("dcs", "hang")] and injected == ["dcs"]
    fire(3)
    fire(4)
    assert calls == [("dcs", "hang"), ("reward", "inject_fault", "kill")] and injected == ["dcs", "reward"]
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
