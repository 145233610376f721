"""The ToolBox: every way a tool call can go wrong becomes an observation and an outcome, never a crash.

The tools below are small real tools written for the test (a user tool is exactly this: a class in
a module); the slow and raising ones exist to inject those faults.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlx.agents.tools import TOOLS, Tool, ToolBox, ToolError, build_tool, schema_errors, truncate
from rlx.errors import ConfigError

NO_ARGUMENTS = {"type": "object", "properties": {}}


class Echo(Tool):
    """A user tool: loaded by tests as `tests.unit.test_toolbox:Echo`."""

    name = "echo"
    description = "Repeats a text a number of times."

    def __init__(self, prefix: str = "", **options: object) -> None:
        self.prefix, self.options = prefix, options
        self.parameters = {
            "type": "object",
            "properties": {"text": {"type": "string"}, "times": {"type": "integer"},
                           "tags": {"type": "array", "items": {"type": "string"}},
                           "mode": {"type": "string", "enum": ["plain", "loud"]}},
            "required": ["text"],
            "additionalProperties": False,
        }

    def run(self, arguments: dict) -> str:
        text = self.prefix + arguments["text"] * arguments.get("times", 1)
        return text.upper() if arguments.get("mode") == "loud" else text


class Fails(Tool):
    name, description, parameters = "fails", "Always raises.", NO_ARGUMENTS

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def run(self, arguments: dict) -> str:
        raise self.error


class Waits(Tool):
    """Blocks until released: a hung in-process tool."""

    name, description, parameters = "waits", "Waits.", NO_ARGUMENTS

    def __init__(self) -> None:
        self.release = threading.Event()

    def run(self, arguments: dict) -> str:
        self.release.wait(60)
        return "released"


class NotATool:
    pass


@pytest.fixture()
def box():
    return ToolBox([Echo(), build_tool("calculator")])


def test_specs_are_openai_function_tools(box):
    specs = box.specs()
    assert [spec["function"]["name"] for spec in specs] == ["echo", "calculator"]
    assert all(spec["type"] == "function" and set(spec["function"]) == {"name", "description", "parameters"}
               for spec in specs)
    assert box.names == ["echo", "calculator"]


def test_a_valid_call(box):
    result = box.call("echo", {"text": "ab", "times": 2, "tags": ["x"], "mode": "loud"})
    assert (result.text, result.outcome) == ("ABAB", "ok")
    assert result.latency_s >= 0


def test_arguments_as_a_json_string_are_read(box):
    assert box.call("echo", '{"text": "hi"}').text == "hi"


def test_unknown_tool_lists_the_tools(box):
    result = box.call("search", {"q": "x"})
    assert result.outcome == "unknown_tool"
    assert "'search'" in result.text and "echo, calculator" in result.text
    assert box.call(None, {}).outcome == "unknown_tool"  # type: ignore[arg-type]


@pytest.mark.parametrize("arguments,problem", [
    (["hi"], "arguments must be object, not array"),
    ("not json", "arguments must be object, not string"),
    (None, "arguments must be object, not null"),
    ({}, "missing the required key 'text'"),
    ({"text": 3}, "arguments['text'] must be string, not integer"),
    ({"text": "a", "times": "2"}, "arguments['times'] must be integer, not string"),
    ({"text": "a", "times": True}, "arguments['times'] must be integer, not boolean"),
    ({"text": "a", "times": 1.5}, "arguments['times'] must be integer, not number"),
    ({"text": "a", "tags": ["x", 1]}, "arguments['tags'][1] must be string, not integer"),
    ({"text": "a", "mode": "quiet"}, 'arguments[\'mode\'] must be one of ["plain", "loud"]'),
    ({"text": "a", "colour": "red"}, "unknown key 'colour'"),
])
def test_bad_arguments_say_what_to_fix(box, arguments, problem):
    result = box.call("echo", arguments)
    assert result.outcome == "bad_arguments"
    assert problem in result.text
    assert '"required": ["text"]' in result.text  # the schema, so the model can retry correctly


def test_schema_errors_accepts_what_json_schema_accepts():
    schema = {"type": "object", "properties": {"n": {"type": "number"}, "k": {"type": ["integer", "null"]}}}
    assert schema_errors({"n": 1, "k": None}, schema) == []
    assert schema_errors({"n": 2.5, "k": 3.0}, schema) == []  # 3.0 is an integer in JSON schema
    assert schema_errors({"n": False}, schema) == ["arguments['n'] must be number, not boolean"]


@pytest.mark.parametrize("error,text", [
    (ValueError("boom"), "ValueError: boom"),
    (KeyError("k"), "KeyError: 'k'"),
    (ToolError("Error: told by the tool"), "Error: told by the tool"),
    (SystemExit(3), "SystemExit: 3"),
])
def test_a_raising_tool_is_an_error_observation(error, text):
    result = ToolBox([Fails(error)]).call("fails", {})
    assert (result.text, result.outcome) == (text, "error")


def test_a_hung_tool_times_out_and_is_abandoned():
    tool = Waits()
    tool.timeout_s = 0.2
    box = ToolBox([tool])
    try:
        result = box.call("waits", {})
        assert result.outcome == "timeout"
        assert "did not finish within 0.2 s" in result.text
        assert 0.2 <= result.latency_s < 30  # generous: it returned long before the tool would
        assert any(thread.name == "tool-waits" for thread in threading.enumerate())  # still running
    finally:
        tool.release.set()  # end the abandoned thread


def test_output_is_truncated_to_max_output_chars():
    box = ToolBox([Echo()], max_output_chars=200)
    long = "".join(f"{i:05d}" for i in range(2000))  # 10000 distinct characters
    result = box.call("echo", {"text": long})
    assert result.outcome == "ok"
    assert len(result.text) <= 200
    assert "truncated" in result.text and "of 10000 characters" in result.text
    assert result.text.startswith(long[:40]) and result.text.endswith(long[-20:])
    assert box.call("echo", {"text": "short"}).text == "short"


def test_truncate_keeps_tiny_limits():
    assert truncate("x" * 100, 16) == "x" * 16
    assert truncate("abc", 3) == "abc"


def test_calls_run_concurrently_from_eight_threads():
    """Eight calls meet at a barrier: it breaks (an error result) unless all eight run at once."""
    barrier = threading.Barrier(8, timeout=20)

    class Meets(Echo):
        name = "meets"

        def run(self, arguments: dict) -> str:
            barrier.wait()
            return super().run(arguments)

    tool = Meets()
    tool.timeout_s = 30
    box = ToolBox([tool, build_tool("calculator")])
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: box.call("meets", {"text": str(i)}), range(8)))
        sums = list(pool.map(lambda i: box.call("calculator", {"expression": f"{i} * 1000 + 7"}), range(64)))
    assert [(r.outcome, r.text) for r in results] == [("ok", str(i)) for i in range(8)]
    assert [r.text for r in sums] == [str(i * 1000 + 7) for i in range(64)]


def test_extra_latency_is_wall_time_without_cpu():
    box = ToolBox([Echo()], extra_latency_s=0.3)
    cpu_before = time.thread_time()
    result = box.call("echo", {"text": "x"})
    assert result.outcome == "ok"
    assert result.latency_s >= 0.3
    assert time.thread_time() - cpu_before < 0.2  # slept, did not spin
    assert box.call("nope", {}).latency_s >= 0.3  # a remote API answers errors after the round trip too


def test_user_tool_by_path_with_options():
    tool = build_tool("tests.unit.test_toolbox:Echo", {"prefix": ">", "timeout_s": 3, "extra": 1})
    assert isinstance(tool, Echo)
    assert (tool.prefix, tool.options, tool.timeout_s) == (">", {"extra": 1}, 3.0)
    assert ToolBox([tool]).call("echo", {"text": "a"}).text == ">a"
    assert build_tool("tests.unit.test_toolbox:Echo").prefix == ""  # no options: no-arg construction


@pytest.mark.parametrize("name,options,message", [
    ("no_such_module_xyz:Tool", None, "cannot load 'Tool' from module 'no_such_module_xyz'"),
    ("tests.unit.test_toolbox:Missing", None, "cannot load 'Missing'"),
    ("tests.unit.test_toolbox:NotATool", None, "must be a class that subclasses rlx.agents.tools.Tool"),
    ("tests.unit.test_toolbox:Fails", {}, "do not fit tool"),
    ("calculator", {"digits": 3}, "do not fit tool 'calculator'"),
    ("calc", None, "unknown tool 'calc'; use one of ['calculator', 'python']"),
    ("python", {"memory": 1}, "do not fit tool 'python'"),
    ("python", {"python": "/nonexistent/python3"}, "is not an executable"),
])
def test_bad_tool_paths_are_config_errors(name, options, message):
    with pytest.raises(ConfigError, match="rollout.agent.tools") as raised:
        build_tool(name, options)
    assert message in str(raised.value)


def test_a_tool_with_an_unreadable_schema_still_does_not_raise():
    broken = Echo()
    broken.parameters = {"properties": ["text"]}  # not a JSON schema: properties must be an object
    result = ToolBox([broken]).call("echo", {"text": "a"})
    assert result.outcome == "error" and result.text.startswith("Error: AttributeError")


def test_builtins_are_registered():
    assert {"calculator", "python"} <= set(TOOLS.names())


def test_duplicate_names_and_close():
    closed = []

    class Closing(Echo):
        def close(self) -> None:
            closed.append(self.prefix)
            raise RuntimeError("closing fails")  # one tool failing to close must not stop the others

    with pytest.raises(ConfigError, match="two tools named 'echo'"):
        ToolBox([Echo(), Echo()])
    first, second = Closing("a"), Closing("b")
    second.name = "echo2"
    ToolBox([first, second]).close()
    assert closed == ["a", "b"]
