"""User environments in processes of their own: one that hangs, crashes or exits is killed at
`rollout.agent.environment_timeout_s` and ends only its own trajectory (`finish_reason=env_error`).

Each trajectory borrows one warm environment process (rlx.agents.env_process) for its whole
episode, from a pool as large as the rollout's concurrency (processes start on demand and stay
warm). The process builds the user's class from its path, so the environment's state, threads and
child programs live there: killing its process group takes all of them. Messages, rows and steps
cross by pickle; the rollout keeps the tokens, as for an environment in-process.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from rlx.agents.environments import Environment, EnvStep
from rlx.data.rows import Messages, PromptRow
from rlx.isolation import ChildProcess, ProcessFailure, ProcessPool, self_destruct_after

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0  # starting a process and building the environment, not counted in the step deadline


class EnvironmentFailure(RuntimeError):
    """An isolated environment's call failed: it raised, hung past its deadline or its process died."""


def _environment_process() -> ChildProcess:
    return ChildProcess("rlx.agents.env_process", "environment")


class IsolatedEnvironment(Environment):
    """A user environment `path` (package.module:Name, built with `options`) in a pool process; each
    call answers within `timeout_s` or the process is killed and the call raises EnvironmentFailure."""

    def __init__(self, pool: ProcessPool[ChildProcess], path: str, options: dict[str, Any], timeout_s: float) -> None:
        self.pool, self.path, self.timeout_s = pool, path, timeout_s
        self.child = pool.checkout()
        try:
            self.child.started(START_TIMEOUT_S)
            self.tool_specs = self._call("open", (path, options, tuple(sys.path)), START_TIMEOUT_S)
        except BaseException:
            pool.checkin(self.child)
            raise

    def reset(self, row: PromptRow) -> Messages:
        return self._call("reset", row, self.timeout_s)

    def step(self, action: str) -> EnvStep:
        return self._call("step", action, self.timeout_s)

    def close(self) -> None:
        try:
            if self.child.alive:
                self._call("close", None, self.timeout_s)
        except EnvironmentFailure as failure:  # the episode is over either way; its process is replaced
            log.warning("%s", failure)
        finally:
            self.pool.checkin(self.child)

    def _call(self, op: str, payload: Any, timeout_s: float) -> Any:
        late = f"no answer within rollout.agent.environment_timeout_s={timeout_s}s"
        try:
            return self.child.request((op, payload, self_destruct_after(timeout_s)), timeout_s, late)
        except ProcessFailure as failure:
            raise EnvironmentFailure(f"environment {self.path} {op}: {failure}") from None


class IsolatedEnvironments:
    """An environment factory: IsolatedEnvironments of `path` sharing one pool of up to `processes`
    environment processes (stopped by `close`, killed when the factory is dropped)."""

    def __init__(self, path: str, options: dict[str, Any], timeout_s: float, processes: int) -> None:
        self.path, self.options, self.timeout_s = path, options, timeout_s
        self.pool: ProcessPool[ChildProcess] = ProcessPool(_environment_process, processes, "environment")

    def __call__(self) -> IsolatedEnvironment:
        return IsolatedEnvironment(self.pool, self.path, self.options, self.timeout_s)

    def close(self) -> None:
        self.pool.close()
