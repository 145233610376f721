"""A reward pool process: builds rewards from their specs and runs calls one at a time, in its
main thread, so a reward's own signal-based timeouts work here.

Run as `python -m rlx.rewards.pool_process FD`, FD being its end of a socket pair to the pool.
Requests are (op, spec, args, self_destruct_s) with op "load" or "call"; replies are
("ok", value) or ("error", message). An exception, SystemExit included, becomes an error reply
and the process serves on. Each request arms a kernel alarm, so a process whose pool died while
user code held the GIL still ends shortly after its deadline.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable

from rlx.rewards.pool import RewardSpec


def _build(spec: RewardSpec) -> Callable[..., Any]:
    from rlx.rewards import build_reward_fn

    sys.path.extend(entry for entry in spec.sys_path if entry not in sys.path)
    return build_reward_fn(spec.name, spec.extract, spec.format_pattern)


def _handle(op: str, spec: RewardSpec, args: tuple, fns: dict[RewardSpec, Callable[..., Any]],
            loop: asyncio.AbstractEventLoop) -> tuple[str, Any]:
    try:
        if spec not in fns:
            fns[spec] = _build(spec)
        if op == "load":
            return "ok", None
        value = fns[spec](*args)
        if inspect.isawaitable(value):
            value = loop.run_until_complete(value)
        return "ok", value
    except BaseException as exc:  # noqa: BLE001 - user code failed; this process serves on
        return "error", f"{type(exc).__name__}: {exc}"


def serve(conn: Connection) -> None:
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the kernel ends us at the alarm, GIL or not
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes the pool
    loop = asyncio.new_event_loop()  # one loop per process: async rewards may keep loop-bound clients
    fns: dict[RewardSpec, Callable[..., Any]] = {}
    conn.send(("ok", None))
    while True:
        try:
            op, spec, args, self_destruct_s = conn.recv()
        except EOFError:  # the pool closed our socket (or died): nothing more to do
            return
        if self_destruct_s is not None:
            signal.setitimer(signal.ITIMER_REAL, self_destruct_s)
        reply = _handle(op, spec, args, fns, loop)
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - the value would not pickle
            kind = type(reply[1]).__name__
            conn.send(("error", f"the reward returned a {kind}, which cannot be sent back: {exc}"))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
