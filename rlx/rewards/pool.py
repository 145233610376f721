"""A process pool for reward code that may misbehave, so it fails only its own samples.

What runs where:
- in the pool: custom `module:function` rewards (user code), `math_verify` (sympy can run for
  minutes on an adversarial answer) and `format` with a user `reward.format_pattern` (a regex can
  backtrack for ever). Such code may hold the GIL past its deadline, call sys.exit or end the
  interpreter; a pool process can be killed for it and replaced, a thread cannot.
- in the caller's process: the trusted, fast built-ins (exact_match, multiple_choice,
  reasoning_gym, format with its default pattern).

Workers are plain `python -m rlx.rewards.pool_process` subprocesses (not multiprocessing), so they
never re-import the parent's `__main__` (a Ray worker, pytest), and each talks over its own socket
pair. They start on demand, stay warm between calls, and each keeps the rewards it has built.
The pool itself starts no threads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Self

RewardFn = Callable[..., Any]
START_TIMEOUT_S = 120.0  # starting a worker and importing a reward's module, not counted in reward.timeout_s
STOP_TIMEOUT_S = 5.0
_RLX_ROOT = str(Path(__file__).resolve().parents[2])  # so `python -m rlx...` works from a source tree too


@dataclass(frozen=True)
class RewardSpec:
    """What a pool process needs to build the same reward itself: functions do not cross processes."""

    name: str
    extract: str
    format_pattern: str | None = None
    sys_path: tuple[str, ...] = ()  # the parent's import path when the reward was built (user modules)


class PooledReward:
    """A reward the Reward role runs in its pool; calling it directly runs it in this process."""

    def __init__(self, spec: RewardSpec, fn: RewardFn) -> None:
        self.spec, self.fn = spec, fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"PooledReward({self.spec.name!r})"


class RewardFailure(Exception):
    """A pooled call failed; the message is the sample's reward_error, `kind` its failure class."""

    kind = "error"


class RewardTimeout(RewardFailure, TimeoutError):
    kind = "timeout"


class RewardCrash(RewardFailure):
    kind = "crash"


def _exit_description(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class _Worker:
    """One pool process and its end of the socket pair."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        path = os.pathsep.join(filter(None, [_RLX_ROOT, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        self.proc = subprocess.Popen([sys.executable, "-m", "rlx.rewards.pool_process", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)  # its own process group: see `kill`
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False
        self.loaded: set[RewardSpec] = set()

    @property
    def alive(self) -> bool:
        return not self.conn.closed

    def answer(self, timeout_s: float | None, late: str) -> Any:
        """The next reply's payload; a late or dead worker is killed and raises RewardTimeout/RewardCrash."""
        try:
            on_time = self.conn.poll(timeout_s)
            status, payload = self.conn.recv() if on_time else ("late", None)
        except (EOFError, OSError):
            code = self._reap()
            raise RewardCrash(f"the reward process {_exit_description(code)} during the call") from None
        if status == "late":
            self.kill()
            raise RewardTimeout(f"{late}; its reward process was killed")
        if status == "error":
            raise RewardFailure(payload)
        return payload

    def request(self, message: tuple, timeout_s: float | None, late: str) -> Any:
        try:
            self.conn.send(message)
        except OSError:
            code = self._reap()
            raise RewardCrash(f"the reward process {_exit_description(code)} before the call") from None
        return self.answer(timeout_s, late)

    def _reap(self) -> int | None:
        self.conn.close()
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        """The worker and whatever it started (a reward that runs a program): its whole process group."""
        self.conn.close()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # already gone
            pass
        self.proc.wait()

    def stop(self) -> None:
        """Closing its socket ends an idle worker; one that does not end in time is killed."""
        self._reap()


def _self_destruct(timeout_s: float | None) -> float | None:
    """When a worker ends itself if its pool has not killed it: a little after the pool's deadline."""
    return None if timeout_s is None else timeout_s + STOP_TIMEOUT_S


def _stop_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.kill()
    workers.clear()


class RewardPool:
    """Up to `max_workers` warm reward processes; `call` runs one reward call with a deadline."""

    def __init__(self, max_workers: int = 8, start_timeout_s: float = START_TIMEOUT_S) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers}: a reward pool needs at least one process")
        self.max_workers, self.start_timeout_s = max_workers, start_timeout_s
        self.replaced = 0  # workers killed or dead and started anew
        self._workers: set[_Worker] = set()
        self._idle: list[_Worker] = []
        self._cond = threading.Condition()
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)  # no process outlives the pool

    def pids(self) -> list[int]:
        with self._cond:
            return [w.proc.pid for w in self._workers]

    def call(self, spec: RewardSpec, args: tuple, timeout_s: float | None,
             timeout_setting: str = "reward.timeout_s") -> Any:
        """The reward's value for `args`, or RewardFailure naming why there is none; a timeout's
        message names `timeout_setting`, the config key that set `timeout_s`."""
        worker = self._checkout()
        try:
            self._prepare(worker, spec)
            return worker.request(("call", spec, args, _self_destruct(timeout_s)), timeout_s,
                                  f"no result within {timeout_setting}={timeout_s}s")
        finally:
            self._checkin(worker)

    def _prepare(self, worker: _Worker, spec: RewardSpec) -> None:
        """Wait for a new worker to start and have it build `spec` before the call's deadline starts."""
        if not worker.ready:
            late = f"the reward process did not start within {self.start_timeout_s}s"
            worker.answer(self.start_timeout_s, late)
            worker.ready = True
        if spec not in worker.loaded:
            worker.request(("load", spec, (), _self_destruct(self.start_timeout_s)), self.start_timeout_s,
                           f"reward {spec.name!r} did not load within {self.start_timeout_s}s")
            worker.loaded.add(spec)

    def _checkout(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise RewardFailure("the reward pool is closed")
                while self._idle:
                    worker = self._idle.pop()
                    if worker.proc.poll() is None:
                        return worker
                    self._workers.discard(worker)  # died while idle (OOM killer, a stray kill)
                    worker.kill()
                if len(self._workers) < self.max_workers:
                    return self._start()
                self._cond.wait()

    def _start(self) -> _Worker:
        worker = _Worker()
        self._workers.add(worker)
        return worker

    def _checkin(self, worker: _Worker) -> None:
        """Keep a healthy worker warm; replace a killed or dead one at once, so it boots while idle."""
        with self._cond:
            if worker.alive and not self._closed:
                self._idle.append(worker)
            else:
                self._workers.discard(worker)
                if not worker.alive and not self._closed:
                    self._idle.append(self._start())
                    self.replaced += 1
            self._cond.notify()
        if worker.alive and self._closed:
            worker.stop()

    def close(self) -> None:
        """Stop idle workers now and busy ones when their call returns; later calls fail."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._workers.difference_update(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
