"""Tool-call parsers: a policy turn's text -> the tool calls it makes.

The default reads Hermes/Qwen-style blocks, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
as Qwen2.5/3, Hermes and SmolLM2-style chat templates describe them. A parser never raises on what
the model wrote: a block that is not valid JSON, has no name, or is never closed comes back in
`errors`, which the environment shows the model as an error observation and counts.
A user parser is `package.module:function` with the same signature.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlx.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any  # what the model wrote; the ToolBox checks it against the tool's schema


@dataclass(frozen=True)
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per unusable block, for the model to read

    @property
    def has_tool_use(self) -> bool:
        return bool(self.calls or self.errors)


ToolCallParser = Callable[[str], ParsedTurn]
PARSERS: Registry[ToolCallParser] = Registry("tool-call parser")

_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def _one_call(body: str) -> ToolCall | str:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return 'a tool call must be a JSON object with a "name" string and an "arguments" object'
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # left as a string: the ToolBox reports the schema mismatch
    return ToolCall(payload["name"], arguments)


@PARSERS.register("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    calls, errors = [], []
    for match in _BLOCK.finditer(text):
        if not match.group(2):
            errors.append("the tool call was never closed with </tool_call>")
            continue
        parsed = _one_call(match.group(1).strip())
        (errors if isinstance(parsed, str) else calls).append(parsed)
    return ParsedTurn(calls, errors)


def build_parser(name: str) -> ToolCallParser:
    if ":" in name:
        from rlx.rewards import load_custom_reward

        return load_custom_reward(name, "rollout.agent.parser")
    if name not in PARSERS:
        from rlx.errors import ConfigError

        raise ConfigError(f"rollout.agent.parser={name!r} is unknown; use one of {PARSERS.names()} or module:function")
    return PARSERS.get(name)
