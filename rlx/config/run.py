"""`RunConfig`: one run's sections, and the rules that span them, collected from beside each section.

Each section module holds its own cross-section rules: `conflicts(c)` (errors, each with its fix)
and single-rule functions for warnings (allowed, probably unintended). This module only lists
them, in the order users see them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from rlx.config import algorithm, data, resources, reward, rollout, train
from rlx.config.algorithm import (
    GROUP_RELATIVE,
    AlgorithmConfig,
    CriticConfig,
    TeacherConfig,
    auto_correction,
    resolve_routing_replay,
)
from rlx.config.base import Section
from rlx.config.data import DataConfig
from rlx.config.faults import FaultConfig
from rlx.config.logging import LoggingConfig
from rlx.config.model import ModelConfig
from rlx.config.resources import ResourcesConfig
from rlx.config.reward import RewardConfig
from rlx.config.rollout import RolloutConfig
from rlx.config.train import TrainConfig
from rlx.config.weights import WeightsConfig

CONFLICTS = (data.conflicts, algorithm.conflicts, rollout.conflicts, resources.conflicts, reward.conflicts,
             train.conflicts)
WARNINGS = (algorithm.uncorrected_staleness, train.idle_reduce_dtype, reward.judge_on_another_engine,
            algorithm.idle_reinforce_pp_normalize, algorithm.noisy_k1, resources.actor_fwd_without_gpus,
            train.async_without_checkpoints)


class RunConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    faults: list[FaultConfig] = Field(default_factory=list, description="async mode: faults to inject")

    @model_validator(mode="after")
    def _choices_fit_together(self) -> RunConfig:
        problems = choice_conflicts(self)
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    @model_validator(mode="after")
    def _resolve_behavior_correction(self) -> RunConfig:
        """`algorithm.behavior_correction=auto` depends on other sections: resolved here, once."""
        self.algorithm._resolved_correction = auto_correction(self)[0]
        return self

    @property
    def initial_rollout_replicas(self) -> int:
        """`resources.rollout.replicas`, brought into the autoscaler's range when it is on."""
        replicas, scale = self.resources.rollout.replicas, self.rollout.autoscale
        return min(max(replicas, scale.min_replicas), scale.max_replicas) if scale.enabled else replicas

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.advantage == "gae"

    @property
    def routing_replay(self) -> Literal["off", "r3"]:
        """`algorithm.routing_replay` in effect (`auto` resolved against the model and the engine)."""
        return resolve_routing_replay(self)[0]

    @property
    def uses_teacher(self) -> bool:
        return self.teacher.path is not None

    @property
    def filters_zero_std_groups(self) -> bool:
        """Equal rewards teach nothing only when the advantage is relative to the group's rewards."""
        a = self.algorithm
        return a.filter_zero_std_groups and a.advantage in GROUP_RELATIVE and not self.uses_teacher

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir or Path("runs") / self.logging.name)

    def resolved(self) -> dict[str, str]:
        """What the `auto` settings resolved to (it depends on other sections)."""
        return {"algorithm.behavior_correction": self.algorithm.resolved_correction,
                "algorithm.routing_replay": self.routing_replay}

    def to_yaml(self, redact: bool = False) -> str:
        """The config as given, plus a comment with what `auto` resolved to. `redact`: without the
        secrets a config may hold inline (alert URLs, engines' `api_key`), each named in a comment,
        for the copy kept in the run directory."""
        dumped = self.model_dump(mode="json")
        comments = [f"# {key} resolved to {value}" for key, value in self.resolved().items()]
        if redact:
            comments += [f"# {where} left out (a secret): give it again to reuse this file" for where in redact_secrets(dumped)]
        return "".join(line + "\n" for line in comments) + yaml.safe_dump(dumped, sort_keys=False)


def redact_secrets(dumped: dict[str, Any]) -> list[str]:
    """Remove the secrets from a dumped config in place: `logging.alerts` (Apprise URLs carry tokens) and
    `api_key` in any `engine_options`. Returns where each was."""
    removed = []
    if dumped["logging"]["alerts"]:
        dumped["logging"]["alerts"], removed = [], ["logging.alerts"]
    stack: list[tuple[str, Any]] = [("", dumped)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict):
            if where.endswith("engine_options") and node.pop("api_key", None) is not None:
                removed.append(f"{where}.api_key")
            stack += [(f"{where}.{key}".lstrip("."), value) for key, value in node.items()]
    return sorted(removed)


def choice_conflicts(c: RunConfig) -> list[str]:
    """Algorithm, role and reward choices that cannot work together, each with its fix."""
    return [problem for section in CONFLICTS for problem in section(c)]


def config_warnings(c: RunConfig) -> list[str]:
    """Allowed choices that are probably not what the user wants; `rlx doctor` prints them."""
    return [warning for rule in WARNINGS if (warning := rule(c)) is not None]
