"""An environment process: hosts one user environment at a time for a multi-turn rollout
(rlx.agents.isolated), so an environment that hangs, crashes or exits ends only its trajectory.

Run as `python -m rlx.agents.env_process FD` (rlx.isolation: requests in the main thread, under a
kernel alarm). Ops: "open" (path, options, sys_path) builds an instance and returns its tool specs;
"reset" (row) and "step" (action) call it; "close" closes it.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection
from typing import Any

from rlx.isolation import serve_requests


def serve(conn: Connection) -> None:
    from rlx.rewards import load_custom_reward

    env = None

    def handle(op: str, payload: Any) -> Any:
        nonlocal env
        if op == "open":
            path, options, sys_path = payload
            sys.path.extend(entry for entry in sys_path if entry not in sys.path)
            env = load_custom_reward(path, "rollout.agent.environment")(**options)
            return list(env.tool_specs)
        if env is None:
            raise RuntimeError(f"{op} before open: no environment is open in this process")
        if op == "reset":
            return env.reset(payload)
        if op == "step":
            return env.step(payload)
        closing, env = env, None
        return closing.close()

    serve_requests(conn, handle)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
