"""HealthManager: notices dead replicas by their silence and makes sure their work is not lost.

Every replica beats once a second (rlx/orchestration/heartbeats.py). Serve replaces a replica whose
process died or whose health check failed (a dead worker loop, or one that stopped beating for
`train.hang_timeout_s`: hung). A replica silent for `train.heartbeat_timeout_s` is dead to the
HealthManager: it makes sure (kills the process if it is still there, so it cannot deliver late
duplicates), then recovers its work:
- rows a stateless role took from the bus but never finished go back to the bus;
- a dead Rollout's unfinished groups (fewer than n rows ever reached the bus) are dropped from the
  bus, since partial groups would bias group statistics, and handed out again.
A stateless role with several replicas (`resources.<role>.replicas`) serves on through the others;
each recovery records whether it did (`others_serving`, `role_down_s`).
Stateful roles (Actor, Critic) hold optimizer state: a replacement restarts from the role's newest
checkpoint (a global recovery), or, for roles not in `global_recovery`, losing one stops the run
with a message that says how to continue (`rlx train --resume`). A worker loop that raised (an
out-of-memory error) counts as a death like a lost process: its replica is killed and replaced.

The management API reads `live`, `known` and `recoveries` from its own thread while the driver's
loop observes: they are replaced whole, never changed in place, so a reader holds a consistent
snapshot (the earlier in-place updates gave it "dictionary changed size during iteration").
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from rlx.orchestration.plan import RolePlan
    from rlx.weights import WeightSync

class RoleFailed(RuntimeError):
    """A role could not be kept alive; the message names the role, what happened and what to do."""


@dataclass
class Recovery:
    role: str
    replica: str
    rows_released: int
    groups_requeued: int
    detected_after_s: float | None  # from the injected fault (if any) to the death being noticed
    replaced_after_s: float | None = None  # from the fault (or the last beat) to a new replica's first beat
    died_at: float = 0.0  # monotonic: the injected fault, or the dead replica's last beat
    scope: str = "in place"  # "global": a stateful role restarted from the last checkpoint
    weights_at_death: int | None = None  # the latest published weight version when the death was noticed
    replacement_weight_version: int | None = None  # what the new replica generated with at its first beat
    others_serving: int = 0  # replicas of the same role that were up before the death and still beat
    role_down_s: float | None = None  # the role's own gap: 0 if another replica served on, else replaced_after_s
    cause: str = ""  # why it counts as dead: silent, or its worker failed (the error)


class HealthManager:
    def __init__(self, plan: RolePlan, bus, prompts, heartbeats, group_size: int, dead_after_s: float,
                 max_restarts_per_role: int, max_restarts: int, weights: WeightSync | None = None,
                 global_recovery: frozenset[str] = frozenset()) -> None:
        """`plan` says which roles are stateful and what each one's unfinished work is;
        `global_recovery`: stateful roles whose loss restarts them from the last checkpoint instead
        of stopping the run."""
        self.stateful, self.unfinished_work = plan.stateful_roles, plan.unfinished_work
        self.bus, self.prompts, self.heartbeats, self.group_size = bus, prompts, heartbeats, group_size
        self.weights = weights  # a gone replica must hold no weight version back
        self.global_recovery = global_recovery
        self.dead_after_s = dead_after_s
        self.max_restarts_per_role, self.max_restarts = max_restarts_per_role, max_restarts
        # Read from the API's thread: each is replaced whole under `_writing`, never changed in place.
        # replica -> (role, monotonic time of its first beat, the weight version it first reported)
        self.known: dict[str, tuple[str, float, int | None]] = {}
        self.recoveries: list[Recovery] = []
        self.live: dict[str, dict[str, Any]] = {}  # replica -> its latest beat
        self._writing = threading.Lock()  # the driver's loop, and an engine removed through the API
        self.restarts: Counter = Counter()
        self.faults_at: dict[str, float] = {}  # role -> when a fault was injected into it
        self.retired: set[str] = set()  # rollout engines added by URL and dropped: their beats are no deaths
        self.gone: set[str] = set()  # replicas recovered already: a beat still in flight from one is no new death

    def fault_injected(self, role: str) -> None:
        self.faults_at[role] = time.monotonic()

    def observe(self) -> list[Recovery]:
        """Read every replica's heartbeat; recover the work of the ones that went silent or failed."""
        with self._writing:
            return self._observe()

    def _observe(self) -> list[Recovery]:
        dead, live, new = [], {}, {}
        for replica, beat in self.heartbeats.snapshot().items():
            role, status = beat["role"], beat["status"]
            # a beat sent just before its replica was killed, or after it was recovered
            if status.get("engine_id") in self.retired or replica in self.gone:
                self.heartbeats.forget(replica)
                continue
            if replica not in self.known:
                new[replica] = (role, time.monotonic() - beat["age_s"], status.get("weight_version"))
            if status.get("stopped") and not status.get("failure"):  # scaled in or shut down: it said goodbye
                self._return_work(role, replica)
                self.heartbeats.forget(replica)
            elif status.get("stopped") or status.get("error") or beat["silent_s"] > self.dead_after_s:
                dead.append((role, replica, status, time.monotonic() - beat["silent_s"]))  # failed, or silent
            else:
                live[replica] = beat
        self.known, self.live = {**self.known, **new}, live
        return [self._recover(*death) for death in dead]  # once every live replica is known

    def _cause(self, status: dict[str, Any]) -> str:
        """Why a replica counts as dead, for the messages."""
        if status.get("failure") or status.get("error"):
            return f"its worker failed: {status.get('failure') or status['error']}"
        return f"silent for more than {self.dead_after_s:.0f}s"

    def _recover(self, role: str, replica: str, status: dict[str, Any], last_beat: float) -> Recovery:
        cause = self._cause(status)
        if role in self.stateful and role not in self.global_recovery:
            raise RoleFailed(f"role {role!r} lost its replica {replica} ({cause}); it holds the optimizer state, so "
                             "the run stops here: continue with `rlx train <config> --resume`")
        # a relay of an engine added by URL dies with its server: dropped by UrlEngines, no restart to count
        self.restarts[role] += status.get("engine_id") is None
        if self.restarts[role] > self.max_restarts_per_role or sum(self.restarts.values()) > self.max_restarts:
            raise RoleFailed(f"role {role!r} was replaced {self.restarts[role]} times (all roles: "
                             f"{sum(self.restarts.values())}); limits are train.max_restarts_per_role="
                             f"{self.max_restarts_per_role} and train.max_restarts={self.max_restarts}; "
                             f"the last replica lost: {cause}")
        self.gone.add(replica)
        kill_quietly(status.get("actor_name"))  # a silent replica may only be slow: make sure it is gone
        self.heartbeats.forget(replica)
        weights_now = None
        if self.weights is not None:
            self.weights.forget(replica)
            weights_now = self.weights.version()
        released, requeued = self._return_work(role, replica)
        injected = self.faults_at.pop(role, None)
        died_at = last_beat if injected is None else injected
        others = sum(1 for other, beat in self.live.items() if beat["role"] == role and self.known[other][1] < died_at)
        recovery = Recovery(role, replica, released, requeued,
                            None if injected is None else time.monotonic() - injected, died_at=died_at,
                            scope="global" if role in self.stateful else "in place", weights_at_death=weights_now,
                            others_serving=others, cause=cause)
        self.recoveries = [*self.recoveries, recovery]
        return recovery

    def retire_engine(self, engine_id: str) -> tuple[int, int]:
        """A rollout engine added by URL whose server stopped answering: make sure its replicas are
        gone and hand back what they held, as for a death, but it is no restart and nothing replaces
        it. Returns (rows released, groups requeued)."""
        with self._writing:
            self.retired.add(engine_id)
            released = requeued = 0
            for replica, beat in self.heartbeats.snapshot().items():
                if beat["status"].get("engine_id") != engine_id:
                    continue
                kill_quietly(beat["status"].get("actor_name"))
                self.heartbeats.forget(replica)
                self.live = {other: b for other, b in self.live.items() if other != replica}
                if self.weights is not None:
                    self.weights.forget(replica)
                rows, groups = self._return_work(beat["role"], replica)
                released, requeued = released + rows, requeued + groups
            return released, requeued

    def _replacement(self, recovery: Recovery) -> tuple[float, int | None] | None:
        """(seconds from the death to the first beat, first weight version) of the next replica of
        the same role, if one came."""
        firsts = [(first, version) for replica, (role, first, version) in self.known.items()
                  if role == recovery.role and replica != recovery.replica and first >= recovery.died_at]
        if not firsts:
            return None
        first, version = min(firsts, key=lambda f: f[0])
        return first - recovery.died_at, version

    def _return_work(self, role: str, replica: str) -> tuple[int, int]:
        """Hand back what `replica` took and did not finish: (rows released, groups requeued)."""
        if role == "rollout":
            requeued = self.bus.abandon_incomplete_groups(self.prompts.held_by(replica), self.group_size)
            self.prompts.requeue(replica, requeued)
            return 0, len(requeued)
        return sum(self.bus.release_held(replica, task, done_field)
                   for task, done_field in self.unfinished_work.get(role, [])), 0

    def busy(self) -> dict[str, float]:
        """Each role's busy fraction, averaged over its live replicas."""
        per_role: dict[str, list[float]] = {}
        for beat in self.live.values():
            per_role.setdefault(beat["role"], []).append(beat["status"]["busy_fraction"])
        return {f"busy_{role}": sum(values) / len(values) for role, values in per_role.items()}

    def replicas(self, role: str) -> list[dict[str, Any]]:
        return [{"replica": replica, **beat["status"], "silent_s": beat["silent_s"]}
                for replica, beat in self.live.items() if beat["role"] == role]

    def report(self) -> list[dict[str, Any]]:
        out = []
        for recovery in self.recoveries:
            replacement = self._replacement(recovery)
            if replacement is not None:
                recovery.replaced_after_s, recovery.replacement_weight_version = replacement
            recovery.role_down_s = 0.0 if recovery.others_serving else recovery.replaced_after_s
            out.append({k: v for k, v in asdict(recovery).items() if k != "died_at"})
        return out


def kill_quietly(actor_name: str | None) -> None:
    if not actor_name:
        return
    try:
        ray.kill(ray.get_actor(actor_name, namespace="serve"), no_restart=True)
    except ValueError:  # already gone
        pass
