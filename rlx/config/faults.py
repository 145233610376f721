"""The `faults` section: faults injected on purpose, for tests and drills."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlx.config.base import Section


class FaultConfig(Section):
    """Fault injection for tests and drills: kill, hang or make raise one role's replica, or kill a
    shared actor of the run, after a given step."""

    role: str = Field(description="a role of this run: rollout, reward, advantages, reference, ...; "
                      "dcs, the weight coordinator; or bus, prompts, heartbeats (the run's shared actors)")
    at_step: int = Field(ge=1, description="the actor fires it right after its own step `at_step`; other "
                         "roles get it once the driver has seen that step")
    kind: Literal["kill", "hang", "raise"] = Field(
        "kill", description="kill: the process exits; hang: its worker loop blocks forever without a heartbeat; "
        "raise: its worker loop raises an out-of-memory RuntimeError (roles only)")
