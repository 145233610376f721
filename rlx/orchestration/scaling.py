"""Scaling a Serve application that the cluster can actually hold, in bounded time.

Serve accepts any replica count and waits, without end, for resources that may never come; these
checks say up front what is missing, and give up (putting back what ran before) when replicas do
not start in time.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from rlx.orchestration.api import ScaleRefused, ScaleTimedOut

POLL_S = 0.5
RESTORE_S = 120.0  # the longest wait for the previous replicas to run again after a failed scale


def require_placeable(role: str, per_replica: Mapping[str, float], added: int, fix: str | None = None) -> None:
    """Raise ScaleRefused, naming the resource, when `added` more replicas needing `per_replica`
    each (e.g. {"CPU": 0.5, "GPU": 0}) do not fit in what the cluster has free now. `fix`: what to
    do about it (default: scale to fewer or lower the role's resources)."""
    if added <= 0:
        return
    free, total = ray.available_resources(), ray.cluster_resources()
    for resource, each in per_replica.items():
        needed = each * added
        if needed > free.get(resource, 0.0) + 1e-9:
            raise ScaleRefused(
                f"{added} more {role} replica(s) need {needed:g} {resource} ({each:g} each) but the cluster has "
                f"{free.get(resource, 0.0):g} {resource} free of {total.get(resource, 0.0):g}; "
                + (fix or f"scale to fewer, lower resources.{role}.num_{resource.lower()}s, or add nodes"))


def running_replicas(app: str) -> int | None:
    """RUNNING replicas of a running application; None while it is not RUNNING."""
    status = serve.status().applications.get(app)
    if status is None or status.status != "RUNNING":
        return None
    return sum(d.replica_states.get("RUNNING", 0) for d in status.deployments.values())


def redeploy(target: serve.RunTarget, replicas: int, fallback: serve.RunTarget, timeout_s: float) -> DeploymentHandle:
    """Deploy `target` (a one-deployment application with `replicas` replicas) and wait until all run.
    Past `timeout_s`, deploy `fallback` (what ran before) and raise ScaleTimedOut."""
    handle = serve.run_many([target], wait_for_applications_running=False)[0]
    deadline = time.monotonic() + timeout_s
    while running_replicas(target.name) != replicas:
        if time.monotonic() > deadline:
            status = serve.status().applications.get(target.name)
            why = (status.message if status is not None else "") or "no reason given"
            serve.run_many([fallback], wait_for_applications_running=False)
            restore_deadline = time.monotonic() + max(timeout_s, RESTORE_S)  # bounded too, never forever
            while running_replicas(fallback.name) is None and time.monotonic() < restore_deadline:
                time.sleep(POLL_S)
            raise ScaleTimedOut(f"{target.name}: {replicas} replica(s) did not all start within {timeout_s:g}s "
                                f"(Serve: {why}); the previous replicas were put back")
        time.sleep(POLL_S)
    return handle
