"""The rollout autoscaler's policy and windowing, fed by a real in-process bus's back-pressure."""

from __future__ import annotations

import pytest

from rlx.bus import LocalBus
from rlx.config import AutoscaleConfig
from rlx.orchestration.autoscaler import Autoscaler, scale_target

POLICY = AutoscaleConfig(enabled=True, min_replicas=1, max_replicas=3, window_s=10)


@pytest.mark.parametrize(("pressure", "replicas", "target"), [
    (0.1, 1, 2),  # the trainer starves: one more engine
    (0.1, 3, 3),  # ... but never past max_replicas
    (0.5, 2, 2),  # balanced: stay
    (0.9, 2, 1),  # the rollout waits at the staleness gate: one engine fewer
    (0.9, 1, 1),  # ... but never below min_replicas
    (0.5, 5, 3),  # out of bounds (a manual scale): back within them first
])
def test_scale_target_moves_one_replica_toward_the_balance(pressure, replicas, target):
    assert scale_target(pressure, replicas, POLICY) == target


def test_the_autoscaler_decides_on_a_full_window_of_bus_back_pressure():
    bus, gate_rows = LocalBus(), 16
    scaler = Autoscaler(POLICY, gate_rows, now=0.0)
    bus.put({"x": list(range(4))}, group_ids=[0, 0, 1, 1])
    assert len(bus.get("train", ["x"], 2)[0]) == 2  # the trainer took 2 rows: 2 still wait
    waiting = bus.metrics()["bus_waiting:train"]
    assert waiting == 2
    for t in range(0, 10, 2):
        scaler.observe(waiting, now=float(t))
        assert scaler.decide(1, now=float(t)) is None  # not a full window yet
    scaler.observe(waiting, now=10.0)
    assert scaler.back_pressure() == pytest.approx(2 / gate_rows)
    assert scaler.decide(1, now=10.0) == 2
    scaler.restart(now=30.0)  # the scale operation took 20 s
    scaler.observe(15, now=31.0)
    assert scaler.decide(2, now=35.0) is None  # the new count needs its own full window
    scaler.observe(15, now=40.0)
    assert scaler.decide(2, now=40.0) == 1  # 15 of 16 rows wait: the rollout outruns the trainer
