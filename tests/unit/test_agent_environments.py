"""Tool-call parsing and the built-in environments: whatever the model writes becomes an observation
and a counted outcome, never an exception."""

from __future__ import annotations

import pytest

from rlx.agents.calculator import Calculator
from rlx.agents.environments import FeedbackEnvironment, ToolEnvironment, opening_messages
from rlx.agents.parsers import build_parser, parse_hermes
from rlx.agents.tools import ToolBox
from rlx.data.rows import PromptRow
from rlx.errors import ConfigError

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'


def test_hermes_reads_calls_and_reports_unusable_blocks():
    parsed = parse_hermes(f"let me compute {CALL} and {CALL.replace('2 + 3', '7 * 6')}")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "2 + 3"}),
                                                            ("calculator", {"expression": "7 * 6"})]
    assert parsed.errors == []
    string_arguments = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert string_arguments.calls[0].arguments == {"x": 1}
    broken = parse_hermes('<tool_call>{"name": calc}</tool_call> <tool_call>[1]</tool_call> <tool_call>{"name"')
    assert broken.calls == [] and len(broken.errors) == 3
    assert "not valid JSON" in broken.errors[0] and '"name" string' in broken.errors[1]
    assert "never closed" in broken.errors[2]
    assert not parse_hermes("the answer is 5").has_tool_use


def test_an_unknown_parser_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="rollout.agent.parser='xml'"):
        build_parser("xml")


@pytest.fixture()
def tools_env():
    box = ToolBox([Calculator()])
    yield ToolEnvironment(box, parse_hermes, "Use the tools.", [{"role": "user", "content": "example"}])
    box.close()


def test_the_tools_environment_runs_calls_and_turns_mistakes_into_observations(tools_env):
    opening = tools_env.reset(PromptRow("What is 2 + 3?", "5"))
    assert [m["role"] for m in opening] == ["system", "user", "user"] and opening[-1]["content"] == "What is 2 + 3?"
    step = tools_env.step(CALL)
    assert not step.done and step.observation == [{"role": "tool", "name": "calculator", "content": "5"}]
    assert [(r.tool, r.outcome) for r in step.tool_calls] == [("calculator", "ok")]
    garbage = tools_env.step('<tool_call>{"name": "calculator", "arguments": {"expr": 1}}</tool_call>'
                             '<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>oops</tool_call>')
    assert not garbage.done
    assert sorted(r.outcome for r in garbage.tool_calls) == ["bad_arguments", "unknown_tool", "unparsable"]
    assert all(m["role"] == "tool" and m["content"] for m in garbage.observation)
    final = tools_env.step("The answer is 5.")
    assert final.done and final.observation == [] and final.tool_calls == []


def test_the_feedback_environment_asks_again_until_the_answer_is_right():
    env = FeedbackEnvironment(lambda text, label, meta: float(text.strip() == label))
    env.reset(PromptRow("2 + 3 =", "5"))
    wrong = env.step("6")
    assert not wrong.done and wrong.reward == 0.0 and wrong.observation[0]["role"] == "user"
    right = env.step("5")
    assert right.done and right.reward == 1.0


def test_a_system_message_in_the_row_wins_over_the_configured_one():
    row = PromptRow([{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}], "")
    assert opening_messages(row, "configured", []) == row.prompt
