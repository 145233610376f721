"""Environments: what a multi-turn rollout talks to.

An environment turns a dataset row into the first messages of a conversation (`reset`), answers
each policy turn with observation messages (`step`), and says when the episode is over. The
rollout owns the tokens; an environment only ever sees and returns text messages, so it cannot
break token exactness. Built in:
- `tools`: the policy may call tools (`rollout.agent.tools`); a turn without a tool call is its
  final answer, which the run's reward scores.
- `feedback`: no tools; a wrong answer gets "not correct, try again" until it is right or
  `rollout.agent.max_turns` runs out (multi-turn without tools).
An observation may show images, audio or video (`EnvStep.media`, placeholders in its text): the
rollout expands and encodes them as it does a row's, and the trajectory carries them from then on.
A user environment is a class `package.module:Name`, built with `rollout.agent.environment_options`
as keyword arguments, one instance per trajectory.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlx.agents.parsers import ToolCallParser
from rlx.agents.trajectory import ToolCallRecord
from rlx.data.rows import Messages, PromptRow
from rlx.errors import ConfigError
from rlx.registry import Registry
from rlx.rewards.pool import RewardFailure
from rlx.rewards.safe import score_safely

if TYPE_CHECKING:
    from rlx.agents.tools import ToolBox
    from rlx.rewards.pool import RewardPool


@dataclass
class EnvStep:
    observation: Messages = field(default_factory=list)  # messages appended after the policy's turn
    # media the observation shows: modality ("image", "audio", "video") -> items in the order of their
    # placeholders (`<image>`, ...) in the observation's text; an item as in a dataset row (rlx.data.media)
    media: dict[str, list[Any]] = field(default_factory=dict)
    done: bool = False
    reward: float | None = None  # the environment's own reward, if it gives one (reward.name=environment)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)


class Environment(abc.ABC):
    """One episode. `tool_specs` are the OpenAI-style specs the chat template (or the system
    prompt) shows the policy; an environment without tools leaves them empty."""

    tool_specs: Sequence[dict] = ()

    @abc.abstractmethod
    def reset(self, row: PromptRow) -> Messages:
        """The conversation before the policy's first turn."""

    @abc.abstractmethod
    def step(self, action: str) -> EnvStep:
        """React to one policy turn (its text, special tokens removed)."""

    def close(self) -> None:
        """Release what the episode holds (a sandbox, a connection)."""


def opening_messages(row: PromptRow, system_prompt: str | None, examples: Messages) -> Messages:
    """System prompt, then worked example turns, then the row's own prompt."""
    prompt = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
    if prompt and prompt[0]["role"] == "system":
        system, prompt = [prompt[0]], prompt[1:]
    else:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, *examples, *prompt]


class ToolEnvironment(Environment):
    """Tool calls run and come back as `tool` messages; a turn with no tool call ends the episode."""

    def __init__(self, toolbox: ToolBox, parser: ToolCallParser, system_prompt: str | None = None,
                 examples: Messages = ()) -> None:
        self.toolbox, self.parser = toolbox, parser
        self.system_prompt, self.examples = system_prompt, list(examples)
        self.tool_specs = toolbox.specs()

    def reset(self, row: PromptRow) -> Messages:
        return opening_messages(row, self.system_prompt, self.examples)

    def step(self, action: str) -> EnvStep:
        parsed = self.parser(action)
        if not parsed.has_tool_use:
            return EnvStep(done=True)
        observation, records = [], []
        for error in parsed.errors:
            observation.append({"role": "tool", "content": f"Error: {error}"})
            records.append(ToolCallRecord("?", "unparsable", 0.0))
        for call in parsed.calls:
            result = self.toolbox.call(call.name, call.arguments)
            observation.append({"role": "tool", "name": call.name, "content": result.text})
            records.append(ToolCallRecord(call.name, result.outcome, result.latency_s))
        return EnvStep(observation, tool_calls=records)


class FeedbackEnvironment(Environment):
    """Answer, hear whether it is right, try again: multi-turn with no tool involved.

    The run's reward scores each answer through `score_safely`: a pooled reward (math_verify,
    reasoning_gym, user code) runs in `pool`'s killable processes within `timeout_s`
    (`reward.timeout_s`), and a reward that fails ends the trajectory (env_error), not the rollout."""

    def __init__(self, score: Callable[[str, str, dict[str, Any]], float], system_prompt: str | None = None,
                 retry_message: str = "That is not correct. Try again, and reply with only the final answer.",
                 timeout_s: float | None = None, pool: RewardPool | None = None) -> None:
        self.score, self.system_prompt, self.retry_message = score, system_prompt, retry_message
        self.timeout_s, self.pool = timeout_s, pool
        self.row: PromptRow | None = None

    def reset(self, row: PromptRow) -> Messages:
        self.row = row
        return opening_messages(row, self.system_prompt, [])

    def step(self, action: str) -> EnvStep:
        assert self.row is not None, "reset() starts an episode"
        outcome = score_safely(self.score, action, self.row.label, self.row.metadata, self.timeout_s, self.pool)
        if outcome.failed:
            raise RewardFailure(f"the feedback reward failed: {outcome.error}")
        if outcome.score >= 1.0:
            return EnvStep(done=True, reward=outcome.score)
        return EnvStep([{"role": "user", "content": self.retry_message}], reward=outcome.score)


EnvironmentFactory = Callable[[], Environment]
ENVIRONMENTS: Registry[Callable[..., EnvironmentFactory]] = Registry("environment")


@ENVIRONMENTS.register("tools")
def tools_environment(toolbox: ToolBox, parser: ToolCallParser, system_prompt: str | None,
                      examples: Messages, **_: Any) -> EnvironmentFactory:
    return lambda: ToolEnvironment(toolbox, parser, system_prompt, examples)


@ENVIRONMENTS.register("feedback")
def feedback_environment(score: Callable[[str, str, dict[str, Any]], float], system_prompt: str | None,
                         timeout_s: float | None = None, pool: RewardPool | None = None,
                         **options: Any) -> EnvironmentFactory:
    """`pool`: the reward pool its trajectories share (the factory holds it: its processes end with it)."""
    retry = {k: options[k] for k in ("retry_message",) if k in options}
    return lambda: FeedbackEnvironment(score, system_prompt, timeout_s=timeout_s, pool=pool, **retry)


def environment_class(path: str) -> type[Environment]:
    """The user environment class `package.module:Name`, imported (nothing of it is built)."""
    from rlx.rewards import load_custom_reward

    cls = load_custom_reward(path, "rollout.agent.environment")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"rollout.agent.environment={path!r} must be a subclass of rlx.agents.Environment")
    return cls


def user_environment(path: str, options: dict[str, Any]) -> EnvironmentFactory:
    """Instances of a user environment class in this process, its options checked by building one now."""
    cls = environment_class(path)
    try:
        cls(**options).close()  # fails now, naming the options, rather than in the middle of a run
    except TypeError as exc:
        raise ConfigError(f"rollout.agent.environment_options do not fit {path}: {exc}") from None
    return lambda: cls(**options)
