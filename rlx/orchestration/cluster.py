"""Start (or join) a Ray cluster bound to loopback unless told otherwise."""

from __future__ import annotations

import os

import ray
from ray._private import ray_constants


def start_ray(num_cpus: float | None = None, address: str | None = None) -> None:
    """A local cluster on 127.0.0.1 by default; `address` joins an existing one."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    # This variable keeps a single-node cluster on the loopback interface. Ray reads it when it is
    # imported, so the driver (already past its import) gets the constant set directly; the
    # processes Ray starts inherit the variable.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false", "False")
    # workers import user code (custom rewards) the way the driver does: from the working directory
    python_path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",  # always a new cluster: never attach to a crashed run's leftovers
        num_cpus=num_cpus,
        runtime_env={"env_vars": {"PYTHONPATH": python_path}},
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )


def stop_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()
