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
