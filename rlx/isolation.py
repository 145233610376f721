"""Killable child processes for user code that may misbehave: rewards and environments.

User code may hold the GIL past its deadline, call sys.exit, end the interpreter or start programs
of its own; a thread running it cannot be stopped, a process (and its process group) can. The
parent side is `ChildProcess`; the child side is `serve_requests`, run by a module the parent starts
as `python -m <module> FD` (never multiprocessing, so the child never re-imports the parent's
`__main__`: a Ray worker, pytest). They talk over a socket pair; a request is (op, payload,
self_destruct_s), a reply ("ok", value) or ("error", message).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

STOP_TIMEOUT_S = 5.0
_RLX_ROOT = str(Path(__file__).resolve().parents[1])  # so `python -m rlx...` works from a source tree too


class ProcessFailure(Exception):
    """A call into a child process failed; the message says why, `kind` classifies it."""

    kind = "error"


class ProcessTimeout(ProcessFailure, TimeoutError):
    kind = "timeout"


class ProcessCrash(ProcessFailure):
    kind = "crash"


def _exit_description(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def self_destruct_after(timeout_s: float | None) -> float | None:
    """When a child ends itself if its parent has not killed it: a little after the parent's deadline."""
    return None if timeout_s is None else timeout_s + STOP_TIMEOUT_S


class ChildProcess:
    """One child process running `module` and the parent's end of its socket pair. `label` names it
    in errors ("the reward process ...")."""

    def __init__(self, module: str, label: str) -> None:
        self.label = label
        ours, theirs = socket.socketpair()
        path = os.pathsep.join(filter(None, [_RLX_ROOT, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        self.proc = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)  # its own process group: see `kill`
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False  # its first message (sent once it has started) has been read

    @property
    def alive(self) -> bool:
        return not self.conn.closed

    def answer(self, timeout_s: float | None, late: str) -> Any:
        """The next reply's payload; a late or dead child is killed and raises ProcessTimeout/ProcessCrash."""
        try:
            on_time = self.conn.poll(timeout_s)
            status, payload = self.conn.recv() if on_time else ("late", None)
        except (EOFError, OSError):
            code = self._reap()
            raise ProcessCrash(f"the {self.label} process {_exit_description(code)} during the call") from None
        if status == "late":
            self.kill()
            raise ProcessTimeout(f"{late}; its {self.label} process was killed")
        if status == "error":
            raise ProcessFailure(payload)
        return payload

    def request(self, message: tuple, timeout_s: float | None, late: str) -> Any:
        try:
            self.conn.send(message)
        except OSError:
            code = self._reap()
            raise ProcessCrash(f"the {self.label} process {_exit_description(code)} before the call") from None
        return self.answer(timeout_s, late)

    def started(self, timeout_s: float) -> None:
        """Wait (once) for the child to start, up to `timeout_s`."""
        if not self.ready:
            self.answer(timeout_s, f"the {self.label} process did not start within {timeout_s}s")
            self.ready = True

    def _reap(self) -> int | None:
        """Wait for the child to end (a little), then end what it started: its process group."""
        self.conn.close()
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        with contextlib.suppress(ProcessLookupError):  # nothing of its group is left
            os.killpg(self.proc.pid, signal.SIGKILL)
        return code

    def kill(self) -> None:
        """The child and whatever it started (user code that runs a program): its whole process group."""
        self.conn.close()
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """Closing its socket ends an idle child; one that does not end in time is killed."""
        self._reap()


Child = TypeVar("Child", bound=ChildProcess)


def _kill_all(children: set[ChildProcess]) -> None:
    for child in list(children):
        child.kill()
    children.clear()


class ProcessPool(Generic[Child]):
    """Up to `max_workers` warm child processes made by `new_child`: `checkout` lends one (starting
    one, or waiting for one to come back, when none is idle), `checkin` takes it back. The pool
    starts no threads, and no child outlives it."""

    def __init__(self, new_child: Callable[[], Child], max_workers: int, label: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers}: a {label} pool needs at least one process")
        self.max_workers, self.label, self._new_child = max_workers, label, new_child
        self.replaced = 0  # children killed or dead and started anew
        self._workers: set[Child] = set()
        self._idle: list[Child] = []
        self._cond = threading.Condition()
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    def pids(self) -> list[int]:
        with self._cond:
            return [w.proc.pid for w in self._workers]

    def checkout(self) -> Child:
        with self._cond:
            while True:
                if self._closed:
                    raise ProcessFailure(f"the {self.label} pool is closed")
                while self._idle:
                    worker = self._idle.pop()
                    if worker.proc.poll() is None:
                        return worker
                    self._workers.discard(worker)  # died while idle (OOM killer, a stray kill)
                    worker.kill()
                if len(self._workers) < self.max_workers:
                    return self._start()
                self._cond.wait()

    def _start(self) -> Child:
        worker = self._new_child()
        self._workers.add(worker)
        return worker

    def checkin(self, worker: Child) -> None:
        """Keep a healthy child warm; replace a killed or dead one at once, so it boots while idle."""
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
        """Stop idle children now and lent ones when they come back; later checkouts fail."""
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


def serve_requests(conn: Connection, handle: Callable[[str, Any], Any]) -> None:
    """The child's loop: `handle(op, payload)` for each request, in the main thread (so user code's
    own signal-based timeouts work), until the parent closes the socket. An exception, SystemExit
    included, becomes an error reply and the child serves on. Each request arms a kernel alarm, so a
    child whose parent died while user code held the GIL still ends shortly after its deadline."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the kernel ends us at the alarm, GIL or not
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    conn.send(("ok", None))
    while True:
        try:
            op, payload, self_destruct_s = conn.recv()
        except EOFError:  # the parent closed our socket (or died): nothing more to do
            return
        if self_destruct_s is not None:
            signal.setitimer(signal.ITIMER_REAL, self_destruct_s)
        try:
            reply = ("ok", handle(op, payload))
        except BaseException as exc:  # noqa: BLE001 - user code failed; this process serves on
            reply = ("error", f"{type(exc).__name__}: {exc}")
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - the value would not pickle
            conn.send(("error", f"the value returned is a {type(reply[1]).__name__}, which cannot be sent back: {exc}"))
