"""Scoring that never kills a run: a reward that raises, hangs or returns garbage fails only its samples.

Rewards may be plain functions or `async def`. A `PooledReward` given a `pool` runs in that
pool's processes (see rlx.rewards.pool: user code goes there), which kill a call past its deadline
(`reward.timeout_s`). Any other function runs in this process on a thread of its own with the
deadline: a hung one cannot be killed from Python, so its daemon thread is abandoned and the
samples fail with a timeout (a hung coroutine is cancelled). Only rlx's own string matching takes
that path in a run. A sample whose rollout failed (`metadata.rollout_error`: media that would not
decode) fails without being scored. A failure's message is cut to MAX_ERROR_CHARS: it is the
reward code's text, and it goes on the bus and into the log.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlx.rewards.pool import PooledReward, RewardFailure, RewardPool

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 2000
ROLLOUT_ERROR = "rollout_error"  # metadata key: {"kind": ..., "error": ...} of a sample the rollout failed


@dataclass(frozen=True)
class RewardOutcome:
    score: float
    error: str | None = None
    kind: str | None = None  # the failure class: error, timeout, crash or bad_value

    @property
    def failed(self) -> bool:
        return self.error is not None


def bounded(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` cut to `limit` characters, saying how long it was (an exception's message can be megabytes)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars in all)"


def rollout_failure(metadata: dict[str, Any]) -> RewardOutcome | None:
    """The failed outcome of a sample whose rollout failed, which no reward scores; None otherwise."""
    failed = metadata.get(ROLLOUT_ERROR)
    if not isinstance(failed, dict):
        return None
    return RewardOutcome(0.0, bounded(f"the rollout failed: {failed.get('error')}"), str(failed.get("kind")))


def _shown(value: Any) -> str:
    """A short repr for an error message (repr itself fails for an int of over 4300 digits)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - only for the message
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} chars)"


def check_score(value: Any) -> RewardOutcome:
    """A finite float, or a failed outcome (an int too large for a float, like 10**400, fails too)."""
    try:
        score = float(value) if isinstance(value, numbers.Real) else math.nan
    except OverflowError:
        score = math.nan
    if not math.isfinite(score):
        return RewardOutcome(0.0, f"bad reward value {_shown(value)}: expected a finite number", "bad_value")
    return RewardOutcome(score)


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
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=invoke, name="rlx-reward-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no result within reward.timeout_s={timeout_s}s")
    if "error" in box:
        if isinstance(box["error"], asyncio.TimeoutError):
            raise TimeoutError(f"no result within reward.timeout_s={timeout_s}s")
        if not isinstance(box["error"], Exception):  # sys.exit() in a reward fails its sample, not the run
            raise RewardFailure(bounded(f"{type(box['error']).__name__}: {box['error']}"))
        raise box["error"]
    return box["value"]


def _invoke(fn: Callable[..., Any], args: tuple, timeout_s: float | None, pool: RewardPool | None) -> Any:
    if pool is not None and isinstance(fn, PooledReward):
        return pool.call(fn.spec, args, timeout_s)
    return call_with_timeout(fn, args, timeout_s)


def _failure(exc: Exception) -> RewardOutcome:
    if isinstance(exc, RewardFailure):
        error, kind = bounded(str(exc)), exc.kind
    else:
        error, kind = bounded(f"{type(exc).__name__}: {exc}"), "timeout" if isinstance(exc, TimeoutError) else "error"
    log.warning("reward function failed: %s", error)
    return RewardOutcome(0.0, error, kind)


def score_safely(fn: Callable[..., Any], completion: str, label: str, metadata: dict[str, Any],
                 timeout_s: float | None = None, pool: RewardPool | None = None) -> RewardOutcome:
    """One response: fn(completion, label, metadata) -> a finite number."""
    if (failed := rollout_failure(metadata)) is not None:
        return failed
    return outcome_of(fn, (completion, label, metadata), timeout_s, pool)


def outcome_of(fn: Callable[..., Any], args: tuple, timeout_s: float | None = None,
               pool: RewardPool | None = None) -> RewardOutcome:
    """fn(*args) -> a finite number, as an outcome: in `pool` if `fn` is a PooledReward (else on a
    thread), within `timeout_s`; whatever it raises or returns fails only this outcome."""
    try:
        value = _invoke(fn, args, timeout_s, pool)
    except Exception as exc:  # noqa: BLE001 - a user reward may raise anything; the sample fails, the run goes on
        return _failure(exc)
    outcome = check_score(value)
    if outcome.failed:
        log.warning("reward function: %s", outcome.error)
    return outcome


def score_group_safely(fn: Callable[..., Any], completions: list[str], label: str, metadata: dict[str, Any],
                       timeout_s: float | None = None, pool: RewardPool | None = None) -> list[RewardOutcome]:
    """A whole group: fn(completions, label, metadata) -> one finite number per completion."""
    if (failed := rollout_failure(metadata)) is not None:
        return [failed] * len(completions)
    try:
        values = _invoke(fn, (completions, label, metadata), timeout_s, pool)
    except Exception as exc:  # noqa: BLE001 - a user reward may raise anything; the group fails, the run goes on
        return [_failure(exc)] * len(completions)
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        error = f"group reward returned {_shown(values)}; expected a list of {len(completions)} numbers"
        log.warning(error)
        return [RewardOutcome(0.0, error, "bad_value")] * len(completions)
    return [check_score(v) for v in values]
