"""Fault injection (`faults` in the config), for tests and drills: kill, hang or make raise one
role's replica (or kill or hang the weight coordinator, role `dcs`) after a given trainer step.

All of it lives here. The driver side (`DriverFaults`) checks the faults against the run's roles
and fires each once the run reaches its step. The replica side (`inject`, `StepFaults`) does the
damage: a kill exits the process a moment after answering; a hang blocks the worker loop without a
heartbeat, as a deadlocked call would. The Actor fires its own faults at its own step, which is
exact where the driver's view of the step lags.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from rlx.config import FaultConfig, RunConfig
from rlx.errors import ConfigError

if TYPE_CHECKING:
    from rlx.orchestration.plan import RolePlan

COORDINATOR = "dcs"  # the weight coordinator can be killed or hung too
SHARED_ACTORS = ("bus", "prompts", "heartbeats")  # the run's shared Ray actors can be killed (ray.kill)
KILL_DELAY_S = 0.2  # the fault call answers before the process exits


INJECTED_ERROR = "CUDA out of memory. Tried to allocate 20.00 GiB (an injected fault)"


class Faultable(Protocol):
    def hang(self) -> None: ...

    def fail(self, error: Exception) -> None: ...


def inject(kind: str, worker: Faultable, delay_s: float = KILL_DELAY_S) -> None:
    """In a replica: exit the process `delay_s` from now (a remote call answers first; 0: at once),
    hang its worker loop, or make the loop raise (`raise`: an out-of-memory error in the role)."""
    if kind == "hang":
        worker.hang()
    elif kind == "raise":
        worker.fail(RuntimeError(INJECTED_ERROR))
    elif delay_s <= 0:
        os._exit(1)
    else:
        threading.Timer(delay_s, os._exit, args=(1,)).start()


class StepFaults:
    """Faults a worker fires itself right after its own step `at_step` (the Actor's)."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, Callable[[], None]]] = []
        self._lock = threading.Lock()

    def schedule(self, at_step: int, fire: Callable[[], None]) -> None:
        with self._lock:
            self.pending.append((at_step, fire))

    def after_step(self, step: int) -> None:
        with self._lock:
            due = [fire for at, fire in self.pending if at <= step]
            self.pending = [(at, fire) for at, fire in self.pending if at > step]
        for fire in due:
            fire()


class DriverFaults:
    """The driver's schedule: which faults are still to fire, and firing them."""

    def __init__(self, config: RunConfig, plan: RolePlan) -> None:
        roles = [*plan.role_names, COORDINATOR, *SHARED_ACTORS]
        for fault in config.faults:
            if fault.role not in roles:
                raise ConfigError(f"faults: role {fault.role!r} is not part of this run; its roles are "
                                  f"{', '.join(roles)}")
            allowed = ("kill",) if fault.role in SHARED_ACTORS else ("kill", "hang") if fault.role == COORDINATOR else ()
            if allowed and fault.kind not in allowed:
                raise ConfigError(f"faults: {fault.role} takes kind {' or '.join(allowed)}, not {fault.kind!r} "
                                  "(raise is for a role's worker loop)")
        self.pending: list[FaultConfig] = [f for f in config.faults if f.role != "actor"]
        self.actor_faults = [f for f in config.faults if f.role == "actor"]

    def arm_actor(self, call_service: Callable[..., object]) -> None:
        """Hand the Actor its faults: it fires them itself, at its own step."""
        for fault in self.actor_faults:
            call_service("actor", "schedule_fault", fault.kind, fault.at_step)

    def fire_due(self, step: int, call_service: Callable[..., object], coordinator_fault: Callable[[str], None],
                 injected: Callable[[str], None], echo: Callable[[str], None],
                 kill_shared: Callable[[str], None]) -> None:
        """Fire every pending fault whose step the run has reached; `injected(role)` notes the time;
        `kill_shared(name)` kills one of the run's shared actors."""
        for fault in [f for f in self.pending if f.at_step <= step]:
            self.pending.remove(fault)
            echo(f"injecting fault: {fault.kind} {fault.role} after step {step}")
            if fault.role == COORDINATOR:
                coordinator_fault(fault.kind)
            elif fault.role in SHARED_ACTORS:
                kill_shared(fault.role)
            else:
                call_service(fault.role, "inject_fault", fault.kind)
            injected(fault.role)
