"""Heartbeats: every replica of every role reports itself here once a second.

Replicas push, nobody polls them, so the controller sees every replica of a scaled-out role (a
handle call would reach only one) and notices a dead replica by its silence.
"""

from __future__ import annotations

import time
from typing import Any

import ray


class Heartbeats:
    def __init__(self) -> None:
        self.replicas: dict[str, dict[str, Any]] = {}  # replica id -> {role, last, first, status}
        self.phases: dict[str, str] = {}  # rollout engine added by URL -> what it does before its first beat

    def announce(self, engine_id: str, phase: str) -> None:
        """A replica still starting says so ("loading": the latest weights go to its server), as
        beats begin only once it serves."""
        self.phases[engine_id] = phase

    def phase_board(self) -> dict[str, str]:
        return dict(self.phases)

    def clear_phase(self, engine_id: str) -> None:
        self.phases.pop(engine_id, None)

    def beat(self, role: str, replica: str, status: dict[str, Any]) -> None:
        now = time.monotonic()
        entry = self.replicas.setdefault(replica, {"role": role, "first": now})
        entry.update(last=now, status=status)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Each replica's role, seconds since its last beat, seconds since its first, and last status."""
        now = time.monotonic()
        return {replica: {"role": e["role"], "silent_s": now - e["last"], "age_s": now - e["first"],
                          "status": e["status"]} for replica, e in self.replicas.items()}

    def forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)


RemoteHeartbeats = ray.remote(num_cpus=0)(Heartbeats)
