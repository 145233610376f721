"""User environments for the agentic tests (loaded by `package.module:Name`, as users write theirs)."""

from __future__ import annotations

import os
import re
import threading
import time
from typing import ClassVar

from rlx.agents import Environment, EnvStep
from rlx.agents.trajectory import ToolCallRecord
from rlx.data.rows import PromptRow


class ScriptedTool(Environment):
    """Answers each turn with a tool result until `rounds` results were given, then ends."""

    tool_specs = ({"type": "function", "function": {"name": "lookup", "description": "look a value up",
                                                    "parameters": {"type": "object", "properties": {}}}},)

    def __init__(self, rounds: int = 2, describe_tools: bool = True) -> None:
        self.rounds, self.given = rounds, 0
        if not describe_tools:  # a short prompt: no tool description in the system prompt
            self.tool_specs = ()

    def reset(self, row: PromptRow) -> list[dict]:
        return [{"role": "user", "content": row.prompt}]

    def step(self, action: str) -> EnvStep:
        if self.given == self.rounds:
            return EnvStep(done=True, reward=1.0)
        self.given += 1
        return EnvStep([{"role": "tool", "content": f"result {self.given}"}],
                       tool_calls=[ToolCallRecord("lookup", "ok", 0.0)])


class Broken(Environment):
    """Fault injection: the environment itself raises on the first step."""

    def reset(self, row: PromptRow) -> list[dict]:
        return [{"role": "user", "content": row.prompt}]

    def step(self, action: str) -> EnvStep:
        raise RuntimeError("the environment is broken")


class SlowTool(ScriptedTool):
    """ScriptedTool whose tool takes `seconds` of wall time; every call's (start, end) goes to `calls`,
    shared by all instances, so a test can see which trajectories' tools and turns overlapped."""

    calls: ClassVar[list[tuple[float, float]]] = []
    _lock = threading.Lock()

    def __init__(self, rounds: int = 2, seconds: float = 0.5) -> None:
        super().__init__(rounds, describe_tools=False)
        self.seconds = seconds

    def step(self, action: str) -> EnvStep:
        start = time.monotonic()
        time.sleep(self.seconds)
        with self._lock:
            self.calls.append((start, time.monotonic()))
        return super().step(action)


class Hangs(ScriptedTool):
    """Fault injection: the first step holds the GIL for ever (a regex that backtracks exponentially)."""

    def step(self, action: str) -> EnvStep:
        re.match(r"(a+)+$", "a" * 64 + "b")
        return super().step(action)


class Exits(ScriptedTool):
    """Fault injection: the first step ends the interpreter."""

    def step(self, action: str) -> EnvStep:
        os._exit(3)


class SysExits(ScriptedTool):
    """Fault injection: the first step raises SystemExit (not an Exception) in the rollout's process."""

    def step(self, action: str) -> EnvStep:
        raise SystemExit(4)


class Garbage(ScriptedTool):
    """Fault injection: the first step returns what cannot cross a process boundary (a function)."""

    def step(self, action: str) -> EnvStep:
        return EnvStep([{"role": "tool", "content": lambda: None}])


class HangsOnReset(ScriptedTool):
    """Fault injection: reset holds the GIL for ever."""

    def reset(self, row: PromptRow) -> list[dict]:
        re.match(r"(a+)+$", "a" * 64 + "b")
        return super().reset(row)


class ShowsAnImage(Environment):
    """Answers the first turn by showing an image of its own ("and this one?"), ends on the second.
    `placeholders` and `items` set how many `placeholder`s the observation writes and how many images
    it hands over (equal by default; a test makes them differ); `kind` is the modality key it uses."""

    def __init__(self, placeholders: int = 1, items: int = 1, kind: str = "image", placeholder: str = "<image>",
                 size: int = 28) -> None:
        self.placeholders, self.items, self.kind, self.size = placeholders, items, kind, size
        self.placeholder = placeholder
        self.shown = False

    def reset(self, row: PromptRow) -> list[dict]:
        return [{"role": "user", "content": row.prompt}]

    def step(self, action: str) -> EnvStep:
        if self.shown:
            return EnvStep(done=True, reward=1.0)
        self.shown = True
        import numpy as np

        rng = np.random.default_rng(len(action))  # trajectories that answered differently see different images
        images = [rng.integers(0, 256, (self.size, self.size + 8, 3), dtype=np.uint8) for _ in range(self.items)]
        return EnvStep([{"role": "user", "content": "and this one? " + self.placeholder * self.placeholders}],
                       media={self.kind: images} if images else {})
