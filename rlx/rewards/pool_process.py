"""A reward pool process: builds rewards from their specs and runs calls one at a time
(rlx.isolation.serve_requests: in its main thread, under a kernel alarm).

Run as `python -m rlx.rewards.pool_process FD`, FD being its end of a socket pair to the pool.
Requests are "load" or "call" with the payload (spec, args).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from rlx.isolation import serve_requests
from rlx.rewards.pool import RewardSpec


def _build(spec: RewardSpec) -> Callable[..., Any]:
    from rlx.rewards import build_reward_fn

    sys.path.extend(entry for entry in spec.sys_path if entry not in sys.path)
    return build_reward_fn(spec.name, spec.extract, spec.format_pattern)


def serve(conn: Connection) -> None:
    loop = asyncio.new_event_loop()  # one loop per process: async rewards may keep loop-bound clients
    fns: dict[RewardSpec, Callable[..., Any]] = {}

    def handle(op: str, payload: tuple[RewardSpec, tuple]) -> Any:
        spec, args = payload
        if spec not in fns:
            fns[spec] = _build(spec)
        if op == "load":
            return None
        value = fns[spec](*args)
        return loop.run_until_complete(value) if inspect.isawaitable(value) else value

    serve_requests(conn, handle)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
