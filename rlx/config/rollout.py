"""The `rollout` section: how responses are generated (engine, sampling, replicas, agents)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from rlx.config.base import Section
from rlx.generation_engines import GENERATION_ENGINES
from rlx.model_kinds import ROUTE_REPORTING_ENGINES

if TYPE_CHECKING:
    from rlx.config.run import RunConfig


class AutoscaleConfig(Section):
    """Async mode: scale the rollout on bus back-pressure. Back-pressure is the rows waiting for the
    trainer, as a fraction of what the staleness gate lets the rollout get ahead by
    ((max_staleness + 1) steps of rows), averaged over `window_s`."""

    enabled: bool = False
    min_replicas: int = Field(1, ge=1, le=16)
    max_replicas: int = Field(2, ge=1, le=16)
    window_s: float = Field(30.0, gt=0.0, description="back-pressure is averaged over this long; a change "
                            "waits this long after the last one")
    scale_up_below: float = Field(0.25, ge=0.0, description="add a replica when back-pressure is below this: "
                                  "the trainer finds little waiting, so generation is the bottleneck")
    scale_down_above: float = Field(0.75, ge=0.0, description="remove a replica when back-pressure is above this: "
                                    "the rollout runs ahead of the trainer and waits at the staleness gate")

    @model_validator(mode="after")
    def _bounds_are_ordered(self) -> AutoscaleConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"rollout.autoscale.min_replicas={self.min_replicas} exceeds "
                             f"max_replicas={self.max_replicas}: raise max_replicas or lower min_replicas")
        if self.scale_up_below >= self.scale_down_above:
            raise ValueError(f"rollout.autoscale.scale_up_below={self.scale_up_below} must be below "
                             f"scale_down_above={self.scale_down_above}, or the rollout would scale both ways at once")
        return self


class EngineSettings(Section):
    """How a generation engine runs: the Rollout's and the GenRM judge's each have their own."""

    engine: str = Field("hf", description="generation engine: hf, vllm (pip install 'rlx[vllm]'), sglang, "
                        "or one registered in GENERATION_ENGINES")
    engine_options: dict[str, Any] = Field(default_factory=dict,
                                           description="backend-specific settings, passed to the engine as is "
                                           "(sglang: url, api_key, ...; vllm: EngineArgs fields, or url to drive "
                                           "a running vLLM server)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the engine's weights; training precision is train.param_dtype. For the Rollout, "
        "a dtype other than the trainer's makes algorithm.behavior_correction=auto pick tis")

    @field_validator("engine")
    @classmethod
    def _engine_is_known(cls, engine: str) -> str:
        if engine not in GENERATION_ENGINES:
            raise ValueError(f"not a generation engine; use one of {', '.join(GENERATION_ENGINES.names())}")
        return engine


class ToolConfig(Section):
    name: str = Field(description="built-in tool (calculator, python) or a user class package.module:Name")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the tool's constructor; "
                                    "python: rlx.agents.sandbox.SandboxLimits' fields and timeout_s "
                                    "(allow_unsandboxed: true runs model code unconfined where the host cannot confine it)")

    @model_validator(mode="after")
    def _python_options(self) -> ToolConfig:
        """The python tool's options are checked here, before a run starts: a misspelled or string
        `allow_unsandboxed` must not pass silently."""
        if self.name == "python":
            from rlx.agents.sandbox import SandboxLimits

            known = {field.name for field in dataclasses.fields(SandboxLimits)} | {"timeout_s"}
            unknown = sorted(set(self.options) - known)
            if unknown:
                raise ValueError(f"options {unknown} are not python tool options; use some of {sorted(known)}")
            if not isinstance(self.options.get("allow_unsandboxed", False), bool):
                raise ValueError(f"options.allow_unsandboxed must be true or false, not "
                                 f"{self.options['allow_unsandboxed']!r}")
        return self


class AgentConfig(Section):
    """Multi-turn rollouts: the policy talks to an environment (and its tools) turn by turn.
    `rollout.max_new_tokens` bounds each policy turn; `max_trajectory_tokens` the whole response."""

    environment: str = Field("tools", description="tools, feedback, or a user class package.module:Name")
    environment_options: dict[str, Any] = Field(default_factory=dict)
    isolate_environment: bool = Field(True, description="run a user environment (package.module:Name) in a "
                                      "process of its own, killed past environment_timeout_s; false: on its "
                                      "trajectory's thread in the rollout process (starts faster, cannot be killed)")
    environment_timeout_s: float = Field(60.0, gt=0.0, description="an isolated environment's reset or step "
                                         "running longer is killed with its process: the trajectory ends (env_error)")
    environment_processes: int | None = Field(None, ge=1, description="isolated environment processes per rollout "
                                              "replica (about 150 MB each), one per episode in progress; more "
                                              "trajectories wait for one to start (default: concurrency)")
    tools: list[ToolConfig] = Field(default_factory=list, description="the tools environment's tools")
    parser: str = Field("hermes", description="tool-call parser: hermes (<tool_call>{json}</tool_call>) or "
                        "module:function")
    system_prompt: str | None = Field(None, description="replaces data.system_prompt in multi-turn rollouts")
    examples: list[dict[str, Any]] = Field(default_factory=list, description="worked example messages put "
                                           "before each prompt (e.g. one tool round trip)")
    max_turns: int = Field(4, ge=1, description="policy turns per trajectory")
    max_trajectory_tokens: int = Field(1024, ge=1, description="response tokens per trajectory, observations "
                                       "included")
    tool_timeout_s: float = Field(10.0, gt=0.0, description="a tool call running longer fails (its result says so)")
    tool_latency_s: float = Field(0.0, ge=0.0, description="wall time added to each tool call without using "
                                  "the CPU, standing in for a remote sandbox or API (benchmarks)")
    max_tool_output_chars: int = Field(2000, ge=16)
    concurrency: int | None = Field(None, ge=1, description="trajectories in flight per rollout replica "
                                    "(default: rollout.max_batch_size)")


class RolloutConfig(EngineSettings):
    n: int = Field(8, ge=1, description="responses per prompt (the group size)")
    prompts_per_step: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    max_new_tokens: int = Field(64, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end a response")
    max_batch_size: int = Field(64, ge=1, description="sequences decoded together")
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    scale_timeout_s: float = Field(600.0, gt=0, description="longest wait for new rollout replicas to start; a "
                                   "scale past it is undone and reported")
    agent: AgentConfig | None = Field(None, description="multi-turn rollouts with an environment and tools "
                                      "(rlx/agents); unset: one response per prompt")
    agent_app: str | None = Field(None, description="package.module:function(base_url, api_key, row) -> reward: "
                                  "an agent program that plays each episode through an OpenAI-compatible endpoint "
                                  "(needs reward.name=environment)")
    agent_app_timeout_s: float = Field(300.0, gt=0.0, description="an episode running longer is killed and fails")
    # an agent app's episode is bounded: a call past a limit is answered 400 and its episode fails (limit)
    agent_app_max_prompt_tokens: int = Field(4096, ge=1, description="tokens of one call's rendered prompt")
    agent_app_max_calls: int = Field(32, ge=1, description="model calls per episode")
    agent_app_max_trajectory_tokens: int = Field(4096, ge=1, description="response tokens (policy and in between) "
                                                 "of one merged trajectory; a call near it gets fewer new tokens")


def reports_routes(rollout: RolloutConfig) -> bool:
    """Whether the rollout's engine returns the experts it routed to (vLLM does in-process, not by URL)."""
    return rollout.engine in ROUTE_REPORTING_ENGINES and not (rollout.engine == "vllm" and "url" in rollout.engine_options)


def engine_named(rollout: RolloutConfig) -> str:
    by_url = " by URL (engine_options.url)" if "url" in rollout.engine_options else ""
    return f"rollout.engine={rollout.engine}{by_url}"


def conflicts(c: RunConfig) -> list[str]:
    """The two ways to roll out agents, and autoscaling, against the rest of the run."""
    problems = []
    if c.rollout.agent is not None and c.rollout.agent_app is not None:
        problems.append("rollout.agent (an environment rlx drives) and rollout.agent_app (a program that drives "
                        "the policy) are two ways to roll out: set one of them")
    if c.rollout.agent_app is not None and c.reward.name != "environment":
        problems.append(f"rollout.agent_app returns each episode's reward; reward.name={c.reward.name!r} would score "
                        "something else: set reward.name=environment")
    if c.rollout.autoscale.enabled and c.train.mode != "async":
        problems.append("rollout.autoscale scales rollout replicas, which exist in async mode only: "
                        "set train.mode=async, or rollout.autoscale.enabled=false")
    return problems
