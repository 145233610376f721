"""Scales the rollout on bus back-pressure (async mode, `rollout.autoscale`).

Back-pressure is the rows the trainer has yet to take, as a fraction of what the staleness gate
lets the rollout get ahead by. Near 0, the trainer waits for samples: generation is the bottleneck
and another engine helps. Near 1, the rollout runs ahead and waits at the gate: an engine can go.
"""

from __future__ import annotations

from collections import deque

from rlx.config import AutoscaleConfig


def scale_target(back_pressure: float, replicas: int, policy: AutoscaleConfig) -> int:
    """The replica count for an averaged back-pressure: one step at a time, within the bounds."""
    if replicas < policy.min_replicas or replicas > policy.max_replicas:
        return min(max(replicas, policy.min_replicas), policy.max_replicas)
    if back_pressure < policy.scale_up_below:
        return min(replicas + 1, policy.max_replicas)
    if back_pressure > policy.scale_down_above:
        return max(replicas - 1, policy.min_replicas)
    return replicas


class Autoscaler:
    """Averages back-pressure over `window_s`; decides only once it has a full window of readings
    since its start or since the last scale operation (`restart`)."""

    def __init__(self, policy: AutoscaleConfig, gate_rows: int, now: float) -> None:
        """`gate_rows`: the rows the staleness gate lets the rollout get ahead by."""
        self.policy, self.gate_rows = policy, gate_rows
        self.readings: deque[tuple[float, float]] = deque()
        self.window_started = now

    def observe(self, waiting_rows: float, now: float) -> None:
        self.readings.append((now, waiting_rows / self.gate_rows))
        while self.readings and self.readings[0][0] < now - self.policy.window_s:
            self.readings.popleft()

    def back_pressure(self) -> float | None:
        return sum(b for _, b in self.readings) / len(self.readings) if self.readings else None

    def decide(self, replicas: int, now: float) -> int | None:
        """A new replica count, or None to stay."""
        pressure = self.back_pressure()
        if pressure is None or now - self.window_started < self.policy.window_s:
            return None
        target = scale_target(pressure, replicas, self.policy)
        return None if target == replicas else target

    def restart(self, now: float) -> None:
        """Forget the readings: a scale operation ended, and the next decision needs a full window
        of readings taken with the new replica count."""
        self.readings.clear()
        self.window_started = now
