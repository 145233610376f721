"""HealthManager: notices replaced replicas and makes sure their unfinished work is not lost.

Serve replaces a replica whose process died or whose health check failed (a dead or hung worker
loop). Each replica reports its consumer id in its status; when a role's id changes, the old
replica is gone and the HealthManager recovers its work:
- a stateless role's rows that the dead replica took but never finished go back to the bus;
- a dead Rollout's unfinished groups (fewer than n rows ever reached the bus) are dropped from
  the bus, since partial groups would bias group statistics, and handed out again.
Stateful roles (Actor, Critic) hold the optimizer state; losing one stops the run with a clear
message (global recovery from the last checkpoint is `rlx train --resume`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

STATEFUL_ROLES = frozenset({"actor", "critic"})
# role -> (bus task it takes rows for, the field it writes when done with a row)
UNFINISHED_WORK = {
    "reward": ("reward", "reward"),
    "genrm": ("reward", "reward"),
    "advantages": ("advantages", "advantage"),
    "reference": ("reference", "ref_logprobs"),
    "actor_fwd": ("actor_fwd", "old_logprobs"),
    "teacher": ("teacher", "teacher_logprobs"),
}


class RoleFailed(RuntimeError):
    """A role could not be kept alive; the message names the role, what happened and what to do."""


@dataclass
class Recovery:
    role: str
    old_replica: str
    new_replica: str
    rows_released: int
    groups_requeued: int
    replaced_after_s: float | None  # from the injected fault to the new replica's first status


class HealthManager:
    def __init__(self, bus, prompts, group_size: int, max_restarts_per_role: int, max_restarts: int) -> None:
        self.bus, self.prompts, self.group_size = bus, prompts, group_size
        self.max_restarts_per_role, self.max_restarts = max_restarts_per_role, max_restarts
        self.replicas: dict[str, str] = {}
        self.restarts: Counter = Counter()
        self.recoveries: list[Recovery] = []
        self.faults_at: dict[str, float] = {}  # role -> when a fault was injected into it

    def fault_injected(self, role: str) -> None:
        self.faults_at[role] = time.monotonic()

    def observe(self, statuses: dict[str, dict[str, Any]]) -> list[Recovery]:
        """Compare each role's replica with the last one seen; recover the work of any replaced one."""
        found = []
        for role, status in statuses.items():
            if status.get("error") and role in STATEFUL_ROLES:
                raise RoleFailed(f"role {role!r} failed: {status['error']}")
            previous, current = self.replicas.get(role), status["consumer"]
            self.replicas[role] = current
            if previous is not None and previous != current:
                found.append(self._recover(role, previous, current))
        return found

    def _recover(self, role: str, old: str, new: str) -> Recovery:
        if role in STATEFUL_ROLES:
            raise RoleFailed(f"role {role!r} lost its replica {old} (replaced by {new}); it holds the optimizer "
                             "state, so the run stops here: continue with `rlx train <config> --resume`")
        self.restarts[role] += 1
        if self.restarts[role] > self.max_restarts_per_role or sum(self.restarts.values()) > self.max_restarts:
            raise RoleFailed(f"role {role!r} was replaced {self.restarts[role]} times (all roles: "
                             f"{sum(self.restarts.values())}); limits are train.max_restarts_per_role="
                             f"{self.max_restarts_per_role} and train.max_restarts={self.max_restarts}")
        released, requeued = 0, []
        if role == "rollout":
            requeued = self.bus.abandon_incomplete_groups(self.prompts.held_by(old), self.group_size)
            self.prompts.requeue(old, requeued)
        else:
            task, done_field = UNFINISHED_WORK[role]
            released = self.bus.release_held(old, task, done_field)
        injected = self.faults_at.pop(role, None)
        recovery = Recovery(role, old, new, released, len(requeued),
                            None if injected is None else time.monotonic() - injected)
        self.recoveries.append(recovery)
        return recovery

    def report(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.recoveries]
