"""Scoring that never kills a run: a reward that raises, hangs or returns garbage fails only its samples.

Custom rewards may be plain functions or `async def`; either way each call runs off the caller's
thread with a deadline (`reward.timeout_s`). A hung plain function cannot be killed from Python:
its daemon thread is abandoned and the samples fail with a timeout. A hung coroutine is cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardOutcome:
    score: float
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


def check_score(value: Any) -> RewardOutcome:
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        return RewardOutcome(0.0, f"bad reward value {value!r}: expected a finite number")
    return RewardOutcome(float(value))


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """One background event loop per process runs every async reward."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="rlx-reward-loop", daemon=True).start()
        return _loop


def call_with_timeout(fn: Callable[..., Any], args: tuple, timeout_s: float | None) -> Any:
    """fn(*args), awaited if it returns an awaitable; raises TimeoutError after `timeout_s`."""
    box: dict[str, Any] = {}

    def invoke() -> None:
        try:
            value = fn(*args)
            if inspect.isawaitable(value):
                value = asyncio.run_coroutine_threadsafe(asyncio.wait_for(value, timeout_s), _event_loop()).result()
            box["value"] = value
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=invoke, name="rlx-reward-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no result within reward.timeout_s={timeout_s}s")
    if "error" in box:
        if isinstance(box["error"], asyncio.TimeoutError):
            raise TimeoutError(f"no result within reward.timeout_s={timeout_s}s")
        raise box["error"]
    return box["value"]


def _failure(exc: BaseException) -> str:
    log.warning("reward function failed: %s: %s", type(exc).__name__, exc)
    return f"{type(exc).__name__}: {exc}"


def score_safely(fn: Callable[..., Any], completion: str, label: str, metadata: dict[str, Any],
                 timeout_s: float | None = None) -> RewardOutcome:
    """One response: fn(completion, label, metadata) -> a finite number."""
    try:
        value = call_with_timeout(fn, (completion, label, metadata), timeout_s)
    except Exception as exc:  # a user reward may raise anything; the sample fails, the run goes on
        return RewardOutcome(0.0, _failure(exc))
    outcome = check_score(value)
    if outcome.failed:
        log.warning("reward function returned %r; expected a finite number", value)
    return outcome


def score_group_safely(fn: Callable[..., Any], completions: list[str], label: str, metadata: dict[str, Any],
                       timeout_s: float | None = None) -> list[RewardOutcome]:
    """A whole group: fn(completions, label, metadata) -> one finite number per completion."""
    try:
        values = call_with_timeout(fn, (completions, label, metadata), timeout_s)
    except Exception as exc:
        return [RewardOutcome(0.0, _failure(exc))] * len(completions)
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        error = f"group reward returned {values!r:.80}; expected a list of {len(completions)} numbers"
        log.warning(error)
        return [RewardOutcome(0.0, error)] * len(completions)
    return [check_score(v) for v in values]
