"""`rollout.agent` -> an AgentRollout: its environment factory, tools, parser and limits."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rlx.agents.environments import ENVIRONMENTS, EnvironmentFactory, environment_class, user_environment
from rlx.agents.loop import AgentRollout, TurnLimits
from rlx.agents.parsers import build_parser
from rlx.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlx.agents.tools import ToolBox
    from rlx.config import AgentConfig, RunConfig
    from rlx.media.processor import MediaProcessor

log = logging.getLogger(__name__)


def build_toolbox(agent: AgentConfig) -> ToolBox:
    from rlx.agents.tools import ToolBox, build_tool

    tools = []
    for tool in agent.tools:
        built = build_tool(tool.name, tool.options)
        if "timeout_s" not in tool.options:
            built.timeout_s = agent.tool_timeout_s
        tools.append(built)
    return ToolBox(tools, max_output_chars=agent.max_tool_output_chars, extra_latency_s=agent.tool_latency_s)


def environment_factory(config: RunConfig, toolbox: ToolBox | None) -> EnvironmentFactory:
    agent = config.rollout.agent
    assert agent is not None
    system_prompt = agent.system_prompt if agent.system_prompt is not None else config.data.system_prompt
    if ":" in agent.environment:
        if not agent.isolate_environment:
            return user_environment(agent.environment, agent.environment_options)
        from rlx.agents.isolated import IsolatedEnvironments

        environment_class(agent.environment)  # imported here to name a bad path now; built only in its processes

        return IsolatedEnvironments(agent.environment, agent.environment_options, agent.environment_timeout_s,
                                    agent.environment_processes or rollout_concurrency(config))
    if agent.environment not in ENVIRONMENTS:
        raise ConfigError(f"rollout.agent.environment={agent.environment!r} is unknown; use one of "
                          f"{ENVIRONMENTS.names()} or package.module:Name")
    if agent.environment == "tools":
        if not agent.tools:
            raise ConfigError("rollout.agent.environment=tools needs at least one tool: set rollout.agent.tools, "
                              "e.g. [{name: calculator}]")
        return ENVIRONMENTS.get("tools")(toolbox, build_parser(agent.parser), system_prompt, agent.examples,
                                         **agent.environment_options)
    from rlx.rewards import PooledReward, build_reward

    r = config.reward
    score = build_reward(r.name, r.extract, r.format_pattern, r.allow_unconfined)
    pool = score.new_pool(rollout_concurrency(config)) if isinstance(score, PooledReward) else None
    return ENVIRONMENTS.get(agent.environment)(score=score, system_prompt=system_prompt,
                                               timeout_s=config.reward.timeout_s, pool=pool,
                                               **agent.environment_options)


def rollout_concurrency(config: RunConfig) -> int:
    """Trajectories in flight per rollout replica."""
    assert config.rollout.agent is not None
    return config.rollout.agent.concurrency or config.rollout.max_batch_size


def build_agent_rollout(config: RunConfig, engine, tokenizer: PreTrainedTokenizerBase,
                        processor: MediaProcessor | None = None) -> AgentRollout:
    """`processor`: the media processor of a run whose rows carry media (they open the trajectories)."""
    agent = config.rollout.agent
    assert agent is not None
    toolbox = build_toolbox(agent) if agent.tools else None
    rollout = AgentRollout(engine, tokenizer, environment_factory(config, toolbox),
                           TurnLimits(agent.max_turns, agent.max_trajectory_tokens),
                           rollout_concurrency(config), processor)
    check = rollout.template_check
    (log.info if check.exact else log.warning)("chat template, token in / token out: %s", check.detail)
    return rollout
