"""The `reward` section: how responses are scored (a built-in, a user function, or a judge model)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from rlx.config.base import Section
from rlx.config.rollout import EngineSettings

if TYPE_CHECKING:
    from rlx.config.run import RunConfig


class JudgeConfig(EngineSettings):
    """The GenRM judge: a generation engine of its own (never the policy's: `engine`, `engine_options`
    and `dtype` here, not the rollout's) scores each response from a prompt."""

    model: str = Field("smollm2-135m-instruct", description="judge model: built-in name or HF folder")
    prompt: str = Field(
        "Question: {question}\nReference answer: {label}\nCandidate answer: {response}\n"
        "Does the candidate answer match the reference answer? Reply with yes or no.",
        description="judge prompt; fields {question}, {response}, {label}")
    parser: str = Field("yes_no", description="yes_no, score (a number divided by max_score) or module:function")
    max_score: float = Field(10.0, gt=0.0, description="the score parser divides by this")
    max_new_tokens: int = Field(8, ge=1)
    max_batch_size: int = Field(32, ge=1)
    timeout_s: float = Field(300.0, gt=0.0, description="a judge batch still generating after this fails its "
                                                        "unjudged samples (timeout); each parse has reward.timeout_s")


class RewardConfig(Section):
    name: str = Field("reasoning_gym", description="built-in reward, `genrm` (a judge model) or `module:function`")
    extract: Literal["last_number", "answer_tag", "boxed", "none"] = "last_number"
    scope: Literal["sample", "group"] = Field(
        "sample", description="a custom reward scores one response (fn(completion, label, metadata)) or a whole "
        "group (fn(completions, label, metadata) -> list of scores)")
    timeout_s: float = Field(60.0, gt=0.0, description="a reward call running longer fails its samples")
    allow_unconfined: bool = Field(False, description="where this host cannot confine reward processes (no user "
                                   "namespaces), run rewards that read model text unconfined instead of refusing "
                                   "to start")
    format_pattern: str | None = Field(None, description="reward.name=format: regex the whole completion must "
                                       "match (default <think>..</think><answer>..</answer>)")
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong punishment over the last N tokens (0: off)")
    overlong_penalty: float = Field(1.0, ge=0.0, description="penalty at the length cap")


def conflicts(c: RunConfig) -> list[str]:
    if c.reward.scope == "group" and ":" not in c.reward.name:
        return [(f"reward.scope=group needs a custom group reward (module:function); {c.reward.name!r} "
                 "scores one response at a time: set reward.scope=sample")]
    return []


def judge_on_another_engine(c: RunConfig) -> str | None:
    """Warns that the judge does not follow `rollout.engine` (each has its own engine settings)."""
    if c.reward.name == "genrm" and c.rollout.engine != "hf" and "engine" not in c.reward.judge.model_fields_set:
        return (f"the GenRM judge runs on its own engine, reward.judge.engine=hf, not the policy's "
                f"rollout.engine={c.rollout.engine}: set reward.judge.engine (and engine_options) to change it")
    return None
