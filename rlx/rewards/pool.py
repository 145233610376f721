"""A process pool for reward code that may misbehave, so it fails only its own samples.

What runs where:
- in the pool: every scorer that may evaluate the model's text or run for ever on it: custom
  `module:function` rewards (user code), `reasoning_gym` (some of its scorers eval or sympy-parse
  the answer), `math_verify` (sympy can run for minutes on an adversarial answer) and `format`
  with a user `reward.format_pattern` (a regex can backtrack for ever). Such code may hold the GIL
  past its deadline, call sys.exit or end the interpreter; a pool process can be killed for it and
  replaced, a thread cannot.
- in the caller's process: rlx's own string matching (exact_match, multiple_choice, format with
  its default pattern), which never evaluates what it reads.

Workers are plain `python -m rlx.rewards.pool_process` subprocesses (not multiprocessing), so they
never re-import the parent's `__main__` (a Ray worker, pytest), and each talks over its own socket
pair. They start on demand, stay warm between calls, and each keeps the rewards it has built.
Each is confined once, as it starts (rlx.isolation): no network, the interpreter and the import path
read-only and nothing else of the host, a private /tmp, no token in its environment, and not root.
That is a fault boundary against the model's text, not a wall against a hostile user's own code.
The pool itself starts no threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlx.isolation import ChildProcess, ProcessFailure, ProcessPool, self_destruct_after

RewardFn = Callable[..., Any]
START_TIMEOUT_S = 120.0  # starting a worker and importing a reward's module, not counted in reward.timeout_s
# a pooled call's failure (ProcessTimeout, ProcessCrash or an error): the message is the sample's
# reward_error, `kind` its failure class
RewardFailure = ProcessFailure


@dataclass(frozen=True)
class RewardSpec:
    """What a pool process needs to build the same reward itself: functions do not cross processes."""

    name: str
    extract: str
    format_pattern: str | None = None
    sys_path: tuple[str, ...] = ()  # the parent's import path when the reward was built (user modules)


class PooledReward:
    """A reward the Reward role runs in its pool; calling it directly runs it in this process.
    `confined`: whether the pools that run it confine their processes (rlx.rewards.pool_confinement)."""

    def __init__(self, spec: RewardSpec, fn: RewardFn, confined: bool = True) -> None:
        self.spec, self.fn, self.confined = spec, fn, confined

    def new_pool(self, max_workers: int) -> RewardPool:
        """A pool for this reward: user code (`module:function`) sees its import path, rlx's own
        scorers only the interpreter and rlx (not the working directory, its data or its runs)."""
        return RewardPool(max_workers, confined=self.confined, imports=":" in self.spec.name)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"PooledReward({self.spec.name!r})"


class _Worker(ChildProcess):
    """One pool process, and the rewards it has built."""

    def __init__(self, confined: bool = True, imports: bool = True) -> None:
        super().__init__("rlx.rewards.pool_process", "reward", confined, imports)
        self.loaded: set[RewardSpec] = set()


@functools.cache
def confinement_problem() -> str | None:
    """Why this host cannot confine reward processes, or None: found once per process by starting one."""
    worker = _Worker(confined=True)
    try:
        worker.started(START_TIMEOUT_S)
    except ProcessFailure as failure:
        return str(failure)
    finally:
        worker.stop()
    return None


class RewardPool(ProcessPool[_Worker]):
    """Up to `max_workers` warm reward processes; `call` runs one reward call with a deadline.
    `confined` (the default): each process is isolated once as it starts (rlx.isolation.confinement),
    so a call costs nothing more; False only for code that must reach the network (agent apps).
    `imports`: whether its processes see the import path (user code) or only the interpreter and rlx."""

    def __init__(self, max_workers: int = 8, start_timeout_s: float = START_TIMEOUT_S, confined: bool = True,
                 imports: bool = True) -> None:
        super().__init__(functools.partial(_Worker, confined, imports), max_workers, "reward")
        self.start_timeout_s = start_timeout_s

    def call(self, spec: RewardSpec, args: tuple, timeout_s: float | None,
             timeout_setting: str = "reward.timeout_s") -> Any:
        """The reward's value for `args`, or RewardFailure naming why there is none; a timeout's
        message names `timeout_setting`, the config key that set `timeout_s`."""
        worker = self.checkout()
        try:
            self._prepare(worker, spec)
            return worker.request(("call", (spec, args), self_destruct_after(timeout_s)), timeout_s,
                                  f"no result within {timeout_setting}={timeout_s}s")
        finally:
            self.checkin(worker)

    def _prepare(self, worker: _Worker, spec: RewardSpec) -> None:
        """Wait for a new worker to start and have it build `spec` before the call's deadline starts."""
        worker.started(self.start_timeout_s)
        if spec not in worker.loaded:
            worker.request(("load", (spec, ()), self_destruct_after(self.start_timeout_s)), self.start_timeout_s,
                           f"reward {spec.name!r} did not load within {self.start_timeout_s}s")
            worker.loaded.add(spec)
