"""Tools the policy calls during a multi-turn rollout, and the ToolBox that runs them safely.

A `Tool` has a name, a description and a JSON schema of its arguments (shown to the model as an
OpenAI function spec) and a `run(arguments) -> str`. The `ToolBox` is the only caller: it never
raises, because whatever the model wrote (an unknown tool, arguments of the wrong shape) and
whatever the tool did (raised, hung) is something the model should read and the metrics should
count, not a crash. Every call ends with a `ToolResult` whose `outcome` is one of `OUTCOMES`.

Deadlines: a call runs in its own daemon thread and the ToolBox waits `timeout_s + grace_s`. A
thread cannot be killed, so an in-process tool that overruns is abandoned: its thread keeps going
in the background until the tool returns, and its result is dropped. Tools that may hang for real
should enforce their own deadline, as the `python` tool does (its code runs in a child process
that is killed at `timeout_s`, so it never leaves work behind; `grace_s` is its time to clean up).

One tool instance serves every trajectory of a rollout replica, from many threads at once, so a
tool's `run` must be thread-safe.

Built in: `calculator` (rlx.agents.calculator) and `python` (rlx.agents.sandbox; building it fails
with a ConfigError where the host cannot confine it, unless its options say `allow_unsandboxed: true`).
A user tool is a class `package.module:Name` subclassing `Tool`, built with the tool's `options` as
keyword arguments.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from rlx.agents.calculator import Calculator
from rlx.agents.sandbox import PythonTool
from rlx.agents.tool import Tool, ToolError, ToolTimeout
from rlx.errors import ConfigError
from rlx.registry import Registry

log = logging.getLogger(__name__)

OUTCOMES = ("ok", "error", "timeout", "bad_arguments", "unknown_tool")


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model sees as the tool's observation (errors included, truncated)
    outcome: str  # one of OUTCOMES
    latency_s: float


# The built-in tools by name; a user tool is named by its class instead (`build_tool`).
TOOLS: Registry[type[Tool]] = Registry("tool")
TOOLS.register("calculator")(Calculator)
TOOLS.register("python")(PythonTool)

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


def schema_errors(value: Any, schema: dict, where: str = "arguments") -> list[str]:
    """What is wrong with `value` under a JSON schema's basic keywords: type, properties, required,
    additionalProperties (false), items, enum. Enough to tell the model what to fix."""
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, name) for name in allowed):
            return [f"{where} must be {' or '.join(allowed)}, not {_json_type(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where} must be one of {json.dumps(schema['enum'])}"]
    errors: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        errors += [f"{where} is missing the required key {key!r}" for key in schema.get("required", [])
                   if key not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{where} has the unknown key {key!r}" for key in value if key not in properties]
        for key, sub in properties.items():
            if key in value:
                errors += schema_errors(value[key], sub, f"{where}[{key!r}]")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{i}]")
    return errors


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False  # JSON keeps booleans apart from numbers; Python's bool is an int
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(name, object))


def _json_type(value: Any) -> str:
    return next((name for name in ("null", "boolean", "integer", "number", "string", "array", "object")
                 if _is_type(value, name)), type(value).__name__)


def truncate(text: str, limit: int) -> str:
    """At most `limit` characters: the head and the tail (where errors and results usually are),
    with a note of how much was cut in between."""
    if len(text) <= limit:
        return text
    note = f"\n[... output truncated: {len(text) - limit} of {len(text)} characters not shown ...]\n"
    kept = max(limit - len(note), 0)
    head = kept * 2 // 3
    return text[:head] + note + text[len(text) - (kept - head):] if kept else text[:limit]


class ToolBox:
    """Runs tool calls for many trajectories at once; `call` never raises."""

    def __init__(self, tools: list[Tool], max_output_chars: int = 2000, extra_latency_s: float = 0.0) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self._tools:
                raise ConfigError(f"rollout.agent.tools has two tools named {tool.name!r}; keep one")
            self._tools[tool.name] = tool
        self.max_output_chars = max_output_chars
        self.extra_latency_s = extra_latency_s  # stands in for a remote sandbox or API: wall time, no CPU

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def specs(self) -> list[dict]:
        return [tool.spec() for tool in self._tools.values()]

    def call(self, name: str, arguments: Any) -> ToolResult:
        start = time.monotonic()
        if self.extra_latency_s:
            time.sleep(self.extra_latency_s)
        try:
            text, outcome = self._dispatch(name, arguments)
        except Exception as exc:  # noqa: BLE001 - e.g. a user tool's schema we cannot read; never raise
            text, outcome = f"Error: {type(exc).__name__}: {exc}", "error"
        return ToolResult(truncate(text, self.max_output_chars), outcome, time.monotonic() - start)

    def close(self) -> None:
        for tool in self._tools.values():
            try:
                tool.close()
            except Exception:  # closing one tool must not keep the others open
                log.exception("closing tool %r failed", tool.name)

    def _dispatch(self, name: str, arguments: Any) -> tuple[str, str]:
        tool = self._tools.get(name) if isinstance(name, str) else None
        if tool is None:
            known = ", ".join(self._tools)
            return f"Error: there is no tool named {name!r}; the tools are: {known}.", "unknown_tool"
        if isinstance(arguments, str):  # arguments written as a JSON string (OpenAI's wire format)
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # reported below as a string where an object is expected
        errors = schema_errors(arguments, {**tool.parameters, "type": "object"})
        if errors:
            return (f"Error: bad arguments for {name}: {'; '.join(errors[:5])}. "
                    f"Its arguments follow this JSON schema: {json.dumps(tool.parameters)}"), "bad_arguments"
        return _run_with_deadline(tool, arguments)


def _run_with_deadline(tool: Tool, arguments: dict) -> tuple[str, str]:
    """(observation, outcome) of one call, waiting at most timeout_s + grace_s for it."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["text"] = tool.run(arguments)
        except BaseException as exc:  # noqa: BLE001 - a tool's failure is an observation, whatever it is
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True).start()
    if not done.wait(tool.timeout_s + tool.grace_s):
        log.warning("tool %r overran its %.3g s deadline; its thread is abandoned and keeps running",
                    tool.name, tool.timeout_s)
        return f"Error: {tool.name} did not finish within {tool.timeout_s:g} s and was abandoned.", "timeout"
    error = box.get("error")
    if error is None:
        text = box["text"]
        return (text if isinstance(text, str) else str(text)), "ok"
    if isinstance(error, ToolTimeout):
        return str(error), "timeout"
    if isinstance(error, ToolError):
        return str(error), "error"
    return f"{type(error).__name__}: {error}", "error"


def build_tool(name: str, options: dict | None = None) -> Tool:
    """A built-in tool by name, or a user class `package.module:Name` (a `Tool` subclass), built with
    `options` as keyword arguments; `timeout_s` in the options sets the tool's deadline for any tool."""
    options = dict(options or {})
    timeout_s = options.pop("timeout_s", None)
    if ":" in name:
        from rlx.rewards import load_custom_reward

        cls = load_custom_reward(name, "rollout.agent.tools")
        if not (isinstance(cls, type) and issubclass(cls, Tool)):
            raise ConfigError(f"rollout.agent.tools: {name!r} must be a class that subclasses "
                              "rlx.agents.tools.Tool (name, description, parameters, run)")
    elif name in TOOLS:
        cls = TOOLS.get(name)
    else:
        raise ConfigError(f"rollout.agent.tools: unknown tool {name!r}; use one of {TOOLS.names()} "
                          "or a class package.module:Name")
    try:
        tool = cls(**options)
    except TypeError as exc:
        raise ConfigError(f"rollout.agent.tools: the options {sorted(options)} do not fit tool {name!r}: "
                          f"{exc}; fix the tool's options") from None
    if timeout_s is not None:
        tool.timeout_s = float(timeout_s)
    return tool
