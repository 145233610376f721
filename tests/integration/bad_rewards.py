"""Custom rewards that misbehave on request, for the reward pool tests (`module:function` specs).

A sample whose metadata names a `fault` acts it out; every other sample scores 1.0 when the
completion contains the label, so a test can check that the rest of its batch still scores right.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any


def _catastrophic_regex() -> float:
    # Nested quantifiers on a non-matching tail: ~2**40 steps inside re, all with the GIL held.
    return float(re.match(r"(a+)+$", "a" * 40 + "b") is not None)


def _raise() -> float:
    raise RuntimeError("the grader is broken")


def _raise_huge() -> float:
    raise RuntimeError("x" * 10_000_000)  # a 10 MB message


FAULTS: dict[str, Callable[[], Any]] = {
    "gil_regex": _catastrophic_regex,
    "sys_exit": lambda: sys.exit(3),
    "os_exit": lambda: os._exit(7),
    "huge_int": lambda: 10**400,
    "raises": _raise,
    "raises_huge": _raise_huge,
}


def starts_a_program_and_hangs(completion: str, label: str, metadata: dict[str, Any]) -> float:
    """A code-running reward whose program never ends: its pid goes to `metadata["pid_file"]`."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(metadata["pid_file"], "w") as out:
        out.write(str(child.pid))
    time.sleep(600)
    return 0.0


def _contains(completion: str, label: str) -> float:
    return float(label in completion)


def misbehaves(completion: str, label: str, metadata: dict[str, Any]) -> Any:
    fault = metadata.get("fault")
    return FAULTS[fault]() if fault else _contains(completion, label)


async def blocks_the_loop(completion: str, label: str, metadata: dict[str, Any]) -> float:
    if metadata.get("fault"):
        time.sleep(60)  # noqa: ASYNC251 - the fault: a blocking call inside async def, which no loop can cancel
    return _contains(completion, label)


def misbehaves_per_group(completions: list[str], label: str, metadata: dict[str, Any]) -> Any:
    fault = metadata.get("fault")
    return FAULTS[fault]() if fault else [_contains(c, label) for c in completions]


def judge_raises(text: str, max_score: float) -> float:
    """A GenRM parser that fails with an error other than ValueError."""
    raise TypeError("the parser is broken")


def judge_nan(text: str, max_score: float) -> float:
    return float("nan")


def judge_too_high(text: str, max_score: float) -> float:
    return 2.0
