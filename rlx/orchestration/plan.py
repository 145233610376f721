"""The role plan: which roles a run needs and which bus fields each reads and writes.

Two tables are the single source of this knowledge. `FIELDS` declares every bus field once (its
schema, the task that writes it, the tasks that read it); `ROLES` declares every role (its bus
tasks, when the config needs it, whether it holds state). `build_plan` derives the rest for one
config: the roles to start, each task's input and output fields, the last consumers of a row, what
a dead replica's unfinished work is, and the order colocated mode runs the tasks in.

Adding a field is one line in `FIELDS`. A task reads a field whenever the field's writer is part of
the run; a field some task needs (`needed_when`) while no role of the run writes it is a config
error that names both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from rlx.config import RunConfig
from rlx.errors import ConfigError

ROLLOUT = "rollout"  # the producer task: it creates rows instead of taking them from the bus
ALL_CONSUMERS = ("reward", "advantages", "critic", "critic_train", "teacher", "reference", "actor_fwd", "train")
TOKEN_CONSUMERS = ("critic", "critic_train", "teacher", "reference", "actor_fwd", "train")

Condition = Callable[[RunConfig], bool]


def always(_: RunConfig) -> bool:
    return True


@dataclass(frozen=True)
class FieldSpec:
    """One bus field. `shape` names its dimensions (`T`: one entry per response token, `P`: per
    prompt token, `S`: per position the engine ran, `L`: per MoE layer, `K`: per routed expert); `scope` is `row` (one value per sample) or `group` (one per prompt group, shared
    by its samples); `present_when`: the field exists only in runs under this condition (default:
    whenever its writer runs); `needed_when`: the readers cannot work without it under this condition;
    `primary`: the field that says its writing task is done with a row (one per consuming task)."""

    name: str
    writer: str
    readers: tuple[str, ...]
    dtype: str
    shape: tuple[str, ...] = ()
    scope: Literal["row", "group"] = "row"
    present_when: Condition = always
    needed_when: Condition | None = None
    primary: bool = False

    @property
    def token_aligned(self) -> bool:
        return self.shape[:1] == ("T",)


def _uses_actor_fwd(c: RunConfig) -> bool:
    """ActorFwd computes proximal log-probs in a separate process; colocated mode has no such lag."""
    return c.train.mode == "async" and c.algorithm.resolved_correction == "decoupled"


def _episodes_vary(c: RunConfig) -> bool:
    """An agent app's episode may make several samples (`rlx.agents.app_rollout`)."""
    return c.rollout.agent_app is not None


FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("group_id", ROLLOUT, ALL_CONSUMERS, "int64"),
    FieldSpec("prompt_ids", ROLLOUT, TOKEN_CONSUMERS, "int64", ("P",)),
    FieldSpec("response_ids", ROLLOUT, ("reward", "advantages", *TOKEN_CONSUMERS), "int64", ("T",)),
    FieldSpec("rollout_logprobs", ROLLOUT, ("advantages", "train"), "float32", ("T",)),
    FieldSpec("loss_mask", ROLLOUT, ("advantages", "critic_train", "train"), "float32", ("T",)),  # GAE skips masked
    FieldSpec("agent_stats", ROLLOUT, ("train",), "json"),
    FieldSpec("episode", ROLLOUT, ("advantages",), "int64", present_when=_episodes_vary),
    FieldSpec("episode_rows", ROLLOUT, ("critic_train", "train"), "int64", present_when=_episodes_vary),
    FieldSpec("routed_experts", ROLLOUT, ("reference", "actor_fwd", "train"), "int16", ("S", "L", "K"),
              present_when=lambda c: c.routing_replay == "r3"),
    FieldSpec("media_inputs", ROLLOUT, TOKEN_CONSUMERS, "media", scope="group",
              present_when=lambda c: c.data.has_media),
    FieldSpec("observed_media", ROLLOUT, TOKEN_CONSUMERS, "media",
              present_when=lambda c: c.data.has_media and c.rollout.agent is not None),
    FieldSpec("behavior_version", ROLLOUT, ("train",), "int64"),
    FieldSpec("last_behavior_version", ROLLOUT, ("train",), "int64"),
    FieldSpec("finish_reason", ROLLOUT, ("train",), "str"),
    FieldSpec("response_text", ROLLOUT, ("reward",), "str"),
    FieldSpec("prompt_text", ROLLOUT, ("reward",), "str"),
    FieldSpec("label", ROLLOUT, ("reward",), "str"),
    FieldSpec("metadata", ROLLOUT, ("reward",), "json"),
    FieldSpec("reward", "reward", ("advantages", "train"), "float32", needed_when=always, primary=True),
    FieldSpec("reward_error", "reward", ("advantages", "train"), "str"),
    FieldSpec("values", "critic", ("advantages", "critic_train"), "float32", ("T",),
              needed_when=lambda c: c.uses_critic, primary=True),
    FieldSpec("teacher_logprobs", "teacher", ("advantages", "train"), "float32", ("T",),
              needed_when=lambda c: c.algorithm.advantage == "none", primary=True),
    FieldSpec("advantage", "advantages", ("train",), "float32", needed_when=always, primary=True),
    FieldSpec("token_advantages", "advantages", ("train",), "float32", ("T",)),
    FieldSpec("returns", "advantages", ("critic_train",), "float32", ("T",)),
    FieldSpec("filter_reason", "advantages", ("reference", "critic_train", "train"), "str"),
    FieldSpec("ref_logprobs", "reference", ("train",), "float32", ("T",),
              needed_when=lambda c: c.algorithm.kl_coef > 0, primary=True),
    FieldSpec("old_logprobs", "actor_fwd", ("train",), "float32", ("T",), needed_when=_uses_actor_fwd,
              primary=True),
    FieldSpec("proximal_version", "actor_fwd", ("train",), "int64"),
)


def bus_schema(config: RunConfig) -> tuple[FieldSpec, ...] | None:
    """What the run's bus checks every put against (its `check_schema`): `FIELDS` when
    `train.check_bus_schema` is on (the test suite's runs), else nothing."""
    return FIELDS if config.train.check_bus_schema else None


@dataclass(frozen=True)
class RoleSpec:
    """One role: the bus tasks it serves, when a run needs it, and whether it holds state that
    a replacement must restore (optimizer state: recovered globally from a checkpoint)."""

    name: str
    tasks: tuple[str, ...]
    needed: Condition = always
    stateful: bool = False


# Start order: the Actor first (it publishes weight version 0), the Rollout last (it needs them).
ROLES: tuple[RoleSpec, ...] = (
    RoleSpec("actor", ("train",), stateful=True),
    RoleSpec("reward", ("reward",), lambda c: c.reward.name != "genrm"),
    RoleSpec("genrm", ("reward",), lambda c: c.reward.name == "genrm"),
    RoleSpec("advantages", ("advantages",)),
    RoleSpec("reference", ("reference",), lambda c: c.algorithm.kl_coef > 0),
    RoleSpec("critic", ("critic", "critic_train"), lambda c: c.uses_critic, stateful=True),
    RoleSpec("teacher", ("teacher",), lambda c: c.uses_teacher),
    RoleSpec("actor_fwd", ("actor_fwd",), _uses_actor_fwd),
    RoleSpec(ROLLOUT, (ROLLOUT,)),
)


@dataclass(frozen=True)
class RolePlan:
    """The roles and fields of one run; every list is in a fixed, deterministic order."""

    roles: tuple[RoleSpec, ...]
    fields: tuple[FieldSpec, ...]  # the fields some role of this run writes

    @property
    def role_names(self) -> list[str]:
        return [role.name for role in self.roles]

    @cached_property
    def tasks(self) -> dict[str, str]:
        """Every task of the run -> the role that serves it."""
        return {task: role.name for role in self.roles for task in role.tasks}

    def has(self, role: str) -> bool:
        return role in self.role_names

    def inputs(self, task: str) -> list[str]:
        """The fields `task` reads: every field it is a reader of that some role of the run writes."""
        return [f.name for f in self.fields if task in f.readers]

    def outputs(self, task: str) -> list[str]:
        return [f.name for f in self.fields if f.writer == task]

    @property
    def group_scoped(self) -> frozenset[str]:
        """The fields stored once per prompt group and shared by its rows."""
        return frozenset(f.name for f in self.fields if f.scope == "group")

    def field(self, name: str) -> FieldSpec:
        return next(f for f in self.fields if f.name == name)

    @property
    def final_tasks(self) -> list[str]:
        """The last consumers of a row (they write nothing): a row leaves the bus once all took it."""
        return [task for task in self.tasks if task != ROLLOUT and not self.outputs(task)]

    @property
    def stateful_roles(self) -> frozenset[str]:
        return frozenset(role.name for role in self.roles if role.stateful)

    def primary_output(self, task: str) -> str:
        """The field whose presence on a row says `task` is done with it (a log-prob role's result)."""
        return next(f.name for f in self.fields if f.writer == task and f.primary)

    @property
    def task_outputs(self) -> dict[str, str]:
        """Each writing task -> its primary output field."""
        return {task: self.primary_output(task) for task in self.tasks if task != ROLLOUT and self.outputs(task)}

    @property
    def unfinished_work(self) -> dict[str, list[tuple[str, str | None]]]:
        """Role -> (bus task, done field) for each task it takes rows for. A done field of None:
        the role holds rows until it is done with them, so every row it holds is unfinished."""
        outputs = self.task_outputs
        return {role.name: [(task, outputs.get(task)) for task in role.tasks]
                for role in self.roles if role.tasks != (ROLLOUT,)}

    @property
    def phase_order(self) -> list[str]:
        """The consuming tasks in an order where every task runs after the writers of what it reads
        (a topological order; ties keep table order): the order colocated mode drains them in."""
        done, order = {ROLLOUT}, []
        pending = [task for task in self.tasks if task != ROLLOUT]
        while pending:
            ready = next((task for task in pending
                          if all(self.field(name).writer in done for name in self.inputs(task))), None)
            if ready is None:
                raise ConfigError(f"the bus fields of tasks {pending} depend on each other in a cycle")
            order.append(ready)
            done.add(ready)
            pending.remove(ready)
        return order


def build_plan(config: RunConfig, roles: tuple[RoleSpec, ...] = ROLES,
               fields: tuple[FieldSpec, ...] = FIELDS) -> RolePlan:
    """The plan for `config`; raises ConfigError when a needed field has no writer in the run, or
    when the reads and writes form a cycle."""
    active = tuple(role for role in roles if role.needed(config))
    tasks = {task for role in active for task in role.tasks}
    problems = []
    for spec in fields:
        if spec.writer in tasks or spec.needed_when is None or not spec.needed_when(config):
            continue
        readers = [task for task in spec.readers if task in tasks]
        if readers:
            problems.append(f"task {readers[0]!r} needs field {spec.name!r}, which only the {spec.writer!r} task "
                            f"writes, and no role of this run serves {spec.writer!r}: enable the role that writes "
                            "it, or change the setting that makes it needed")
    if problems:
        raise ConfigError("the roles of this config do not fit together:\n  " + "\n  ".join(problems))
    for task in {spec.writer for spec in fields} - {ROLLOUT}:
        primaries = [spec.name for spec in fields if spec.writer == task and spec.primary]
        if len(primaries) != 1:
            raise ConfigError(f"task {task!r} must mark exactly one field it writes as primary (the one that says "
                              f"it is done with a row); it marks {primaries}")
    plan = RolePlan(active, tuple(spec for spec in fields if spec.writer in tasks and spec.present_when(config)))
    plan.phase_order  # noqa: B018 -- a cycle of reads and writes raises here, at config time
    return plan
