"""Build the roles and workers a run needs from its RunConfig, one role at a time.

Each service of async mode builds only its own role (the Rollout loads no optimizer, the Reward no
model); colocated mode builds them all in one process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self, TypeVar

import torch

from rlx.config import EngineSettings, RunConfig
from rlx.data import PromptRow, PromptStream, load_splits
from rlx.data.prompts import encode_prompt
from rlx.engines.generation import EngineSpec, SamplingParams, build_generation_engine
from rlx.engines.training import TrainingEngine
from rlx.engines.training.forward import token_values
from rlx.errors import ConfigError
from rlx.models import load_pretrained, load_tokenizer, load_value_model, resolve_model_path
from rlx.models.moe import MoeRouting
from rlx.obs.timeline import SPANS
from rlx.orchestration.plan import RolePlan, build_plan
from rlx.orchestration.prompt_source import PromptSource
from rlx.orchestration.rank_group import is_rank_of_group
from rlx.orchestration.staleness import StalenessGate
from rlx.orchestration.workers import (
    NO_CHECKPOINTS,
    ActorWorker,
    AdvantagesWorker,
    Checkpointing,
    CriticWorker,
    LogProbWorker,
    RewardWorker,
    RolloutWorker,
    Worker,
)
from rlx.rewards import build_judge_parser, build_reward
from rlx.roles import Actor, ActorFwd, Advantages, Critic, GenRM, Reference, Reward, Rollout
from rlx.weights.buckets import flatten_parameters

if TYPE_CHECKING:  # transformers costs seconds to import; services without a model skip it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rlx.media.processor import MediaProcessor
    from rlx.orchestration.rank_group import RankGroup

T = TypeVar("T")


def prepare_process(config: RunConfig, threads: int | None = None) -> None:
    threads = threads or config.resources.num_threads
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(config.train.seed)


def model_path(config: RunConfig) -> Path:
    return resolve_model_path(config.model.path)


def sampling_params(config: RunConfig, seed: int | None, greedy: bool = False) -> SamplingParams:
    r = config.rollout
    return SamplingParams(temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, stop=tuple(r.stop),
                          stop_token_ids=tuple(r.stop_token_ids), seed=seed)


def prompt_encoder(config: RunConfig, rollout: Rollout) -> Callable[[PromptRow], list[int]]:
    """Rows -> the prompt ids the rollout takes (its model's media placeholder tokens in place)."""
    data = config.data
    return lambda row: encode_prompt(row, rollout.tokenizer, data.system_prompt, data.apply_chat_template,
                                     data.max_prompt_tokens, rollout.placeholder_text)


def generation_engine(config: RunConfig, settings: EngineSettings, path: Path, max_batch_size: int,
                      record_routes: bool = False):
    """`(engine, tokenizer)` run as `settings` say (`rollout` for the policy, `reward.judge` for GenRM)."""
    spec = EngineSpec(path, settings.dtype, config.resources.device, max_batch_size, config.train.seed,
                      dict(settings.engine_options), record_routes)
    return build_generation_engine(settings.engine, spec)


def build_rollout(config: RunConfig, path: Path) -> Rollout:
    """One response per prompt, or whole multi-turn trajectories when `rollout.agent` is set."""
    engine, tokenizer = generation_engine(config, config.rollout, path, config.rollout.max_batch_size,
                                          record_routes=config.routing_replay == "r3")
    r = config.rollout
    if r.agent is not None:
        from rlx.agents.setup import build_agent_rollout

        return build_agent_rollout(config, engine, tokenizer, media_processor(config, path))
    if r.agent_app is not None:
        from rlx.agents.app_rollout import AgentAppRollout
        from rlx.agents.openai_server import ServerLimits

        limits = ServerLimits(max_prompt_tokens=r.agent_app_max_prompt_tokens, max_calls=r.agent_app_max_calls,
                              max_trajectory_tokens=r.agent_app_max_trajectory_tokens)
        return AgentAppRollout(engine, tokenizer, r.agent_app, r.agent_app_timeout_s, r.max_batch_size, limits)
    return Rollout(engine, tokenizer, media_processor(config, path))


def media_processor(config: RunConfig, path: Path) -> MediaProcessor | None:
    """The processor that turns a row's media into the model's inputs; None for a text-only run."""
    if not config.data.has_media:
        return None
    from rlx.media.processor import processor_for
    from rlx.models import load_model_config

    model_config = load_model_config(path)
    if config.data.processor_workers:
        from rlx.media.pool import MediaProcessorPool

        return MediaProcessorPool(model_config, config.data, config.data.processor_workers)
    return processor_for(model_config, config.data)


def build_genrm(config: RunConfig) -> GenRM:
    judge = config.reward.judge
    parse = build_judge_parser(judge.parser, config.reward.allow_unconfined)  # a bad parser fails before the judge model loads
    engine, tokenizer = generation_engine(config, judge, resolve_model_path(judge.model), judge.max_batch_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=judge.max_new_tokens)
    return GenRM(engine, tokenizer, judge.prompt, parse, judge.max_score, params, timeout_s=judge.timeout_s,
                 parse_timeout_s=config.reward.timeout_s)


def build_critic(config: RunConfig) -> Critic | RankGroup:
    """The Critic: in this process, or over `resources.critic.ranks` rank processes."""
    if config.resources.critic.ranks > 1:
        return rank_group(config, "critic", functools.partial(build_critic_rank, config))
    return build_critic_rank(config)


def build_critic_rank(config: RunConfig) -> Critic:
    path = resolve_model_path(config.critic.path or config.model.path)
    tokenizer = load_tokenizer(path)
    train = config.train.model_copy(update={"lr": config.critic.lr, "grad_clip": config.critic.grad_clip})
    engine = training_engine_class()(load_value_model(path, config.resources.device), tokenizer, train,
                                     config.rollout.temperature, forward=token_values)
    return Critic(engine, tokenizer.pad_token_id, config.critic.value_clip)


def build_teacher(config: RunConfig, student_vocab: int) -> Reference | RankGroup:
    """The Teacher: in this process, or over `resources.teacher.ranks` rank processes."""
    if config.resources.teacher.ranks > 1:
        return rank_group(config, "teacher", functools.partial(build_teacher_rank, config, student_vocab))
    return build_teacher_rank(config, student_vocab)


def build_teacher_rank(config: RunConfig, student_vocab: int) -> Reference:
    model, tokenizer = load_pretrained(resolve_model_path(config.teacher.path), config.train.param_dtype,
                                       config.resources.device)
    if model.config.vocab_size != student_vocab:
        raise ConfigError(f"teacher.path={config.teacher.path!r} has a vocabulary of {model.config.vocab_size} tokens "
                          f"and the student {student_vocab}: distillation scores the student's tokens, so both "
                          "need the same tokenizer")
    return forward_role(config, model)(model, tokenizer.pad_token_id, config.rollout.temperature,
                                       config.train.micro_batch_size, share_prompts=shares_prompts(config))


def load_policy(config: RunConfig, path: Path, dtype: str):
    """`(model, tokenizer)` of the policy for a trainer-side role; with R3 its routers replay the
    routes that batches carry, with a load-balancing loss they keep what it needs. Under bf16
    autocast on CPU every trainer-side copy takes the same attention kernel, so ActorFwd's
    log-probs stay the Actor's own."""
    from rlx.engines.attention import (
        use_cpu_attention,  # imports transformers: services without a model skip it
    )

    model, tokenizer = load_pretrained(path, dtype, config.resources.device)
    if config.train.bf16_autocast:
        use_cpu_attention(model, bf16_training=True)
    if config.routing_replay == "r3" or config.algorithm.router_aux_loss_coef > 0:
        MoeRouting.of(model)
    return model, tokenizer


def build_actor(config: RunConfig, path: Path) -> Actor | RankGroup:
    """The Actor: in this process, or over `resources.actor.ranks` rank processes."""
    if config.resources.actor.ranks > 1:
        return rank_group(config, "actor", functools.partial(build_actor_rank, config, path))
    return build_actor_rank(config, path)


def build_actor_rank(config: RunConfig, path: Path) -> Actor:
    """The Actor of this process: sharded when it is a rank of a process group."""
    model, tokenizer = load_policy(config, path, "float32")
    if not is_rank_of_group():
        # parameters in publish-ready buckets: each DCS publish is then one copy per bucket, no packing
        flatten_parameters(model, int(config.weights.bucket_mb * (1 << 20)))
    engine = training_engine_class()(model, tokenizer, config.train, config.rollout.temperature)
    return Actor(engine, config.algorithm, tokenizer.pad_token_id, build_plan(config).inputs("train"))


def training_engine_class() -> type[TrainingEngine]:
    """The FSDP2 engine on a rank of a process group (imported only there), else the one-process one."""
    if is_rank_of_group():
        from rlx.engines.training.fsdp import sharded_training_engine as ShardedTrainingEngine

        return ShardedTrainingEngine
    return TrainingEngine


def rank_group(config: RunConfig, role: str, build: Callable[[], Actor | Critic | Reference]) -> RankGroup:
    """`build` run on each of the role's ranks, in a Ray cluster (a local one is started for a colocated run)."""
    from rlx.orchestration.cluster import start_ray
    from rlx.orchestration.rank_group import RankGroup

    resources = config.resources
    start_ray(resources.ray_num_cpus, resources.ray_address, resources.ray_allow_unauthenticated)
    each = getattr(resources, role)
    return RankGroup(build, each.ranks, each.num_cpus, each.num_gpus, each.threads, role)


def build_reference(config: RunConfig, path: Path) -> Reference | RankGroup | None:
    """The Reference, if the run has a KL term: in this process, or over `resources.reference.ranks`."""
    if config.algorithm.kl_coef <= 0:
        return None
    if config.resources.reference.ranks > 1:
        return rank_group(config, "reference", functools.partial(build_reference_rank, config, path))
    return build_reference_rank(config, path)


def build_reference_rank(config: RunConfig, path: Path) -> Reference:
    model, tokenizer = load_policy(config, path, config.train.param_dtype)
    return forward_role(config, model)(model, tokenizer.pad_token_id, config.rollout.temperature,
                                       config.train.micro_batch_size, config.algorithm.kl_reference_refresh_every,
                                       share_prompts=shares_prompts(config))


def shares_prompts(config: RunConfig) -> bool:
    """Whether this process's forward-only role runs each shared prompt once: never on a rank of a
    group, whose ranks must run the same forwards in lockstep."""
    return config.train.share_prompts and not is_rank_of_group()


def forward_role(config: RunConfig, model: PreTrainedModel, follows_policy: bool = False) -> type[Reference]:
    """On a rank of a process group: `model` sharded, and the class that runs its forwards in
    lockstep (imported only there); else the one-process class. `follows_policy`: ActorFwd."""
    if not is_rank_of_group():
        return ActorFwd if follows_policy else Reference
    from rlx.roles.sharded import ShardedActorFwd, ShardedReference, shard_model

    shard_model(model, config.train)
    return ShardedActorFwd if follows_policy else ShardedReference


def build_actor_fwd(config: RunConfig, path: Path) -> ActorFwd | RankGroup:
    """ActorFwd: in this process, or over `resources.actor_fwd.ranks` rank processes."""
    if config.resources.actor_fwd.ranks > 1:
        return rank_group(config, "actor_fwd", functools.partial(build_actor_fwd_rank, config, path))
    return build_actor_fwd_rank(config, path)


def build_actor_fwd_rank(config: RunConfig, path: Path) -> ActorFwd:
    """float32 weights under the trainer's autocast: at the same weight version its log-probs are
    the Actor's own, so the proximal ratio is exactly 1 there, not bf16 rounding noise."""
    model, tokenizer = load_policy(config, path, "float32")
    return forward_role(config, model, follows_policy=True)(
        model, tokenizer.pad_token_id, config.rollout.temperature, config.train.micro_batch_size,
        bf16=config.train.bf16_autocast, share_prompts=shares_prompts(config))


def build_reward_role(config: RunConfig) -> Reward | GenRM:
    r = config.reward
    if r.name == "genrm":
        return build_genrm(config)
    return Reward(build_reward(r.name, r.extract, r.format_pattern, r.allow_unconfined), max_length=config.rollout.max_new_tokens,
                  overlong_buffer=r.overlong_buffer, overlong_factor=r.overlong_penalty, scope=r.scope,
                  timeout_s=r.timeout_s)


@dataclass
class Components:
    """Every role of a run, in one process (colocated mode)."""

    config: RunConfig
    plan: RolePlan
    tokenizer: PreTrainedTokenizerBase
    rollout: Rollout
    reward: Reward | GenRM
    advantages: Advantages
    actor: Actor | RankGroup
    reference: Reference | RankGroup | None
    critic: Critic | RankGroup | None
    teacher: Reference | RankGroup | None
    prompts: PromptSource
    eval_rows: list[PromptRow]

    def encode(self, row: PromptRow) -> list[int]:
        return prompt_encoder(self.config, self.rollout)(row)

    def sampling(self, seed: int | None, greedy: bool = False) -> SamplingParams:
        return sampling_params(self.config, seed, greedy)

    def close(self) -> None:
        """End the roles' rank processes, if they have any (a Serve replica's end with its owner)."""
        for role in (self.actor, self.critic, self.reference, self.teacher):
            if hasattr(role, "close"):
                role.close()

    def sync_weights(self) -> None:
        """Colocated weight hand-off: copy the trainer's weights into the generation engine (and
        into a reference that follows the policy, when due)."""
        weights = self.actor.weights()
        self.rollout.load_weights(weights, self.actor.version)
        if self.reference is not None:
            self.reference.refresh(weights, self.actor.version)


def build_components(config: RunConfig) -> Components:
    """Every role of a colocated run in this process; each part a start-up span (`rlx timeline`)."""
    plan = build_plan(config)  # roles that do not fit together fail before anything loads
    prepare_process(config)
    # bad data and prompts over data.max_prompt_tokens fail here, before any model loads
    train_rows, eval_rows = load_data(config)
    reward = started("reward", lambda: build_reward_role(config))
    path = model_path(config)
    rollout = started("rollout", lambda: build_rollout(config, path))
    actor = started("actor", lambda: build_actor(config, path))
    reference = started("reference", lambda: build_reference(config, path)) if plan.has("reference") else None
    critic = started("critic", lambda: build_critic(config)) if plan.has("critic") else None
    teacher = started("teacher", lambda: build_teacher(config, len(rollout.tokenizer))) if plan.has("teacher") else None
    return Components(
        config=config,
        plan=plan,
        tokenizer=rollout.tokenizer,
        rollout=rollout,
        reward=reward,
        advantages=build_advantages(config),
        actor=actor,
        reference=reference,
        critic=critic,
        teacher=teacher,
        prompts=prompt_source(config, train_rows),
        eval_rows=eval_rows,
    )


def started(role: str, build: Callable[[], T]) -> T:
    """`build()` recorded as the role's start-up span, as a service's start is."""
    with SPANS.span("start", role):
        return build()


def load_data(config: RunConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    """The train and held-out splits, as the start-up span `load_data`."""
    with SPANS.span("load_data", "driver"):
        return load_splits(config.data, load_tokenizer(model_path(config)))


def build_advantages(config: RunConfig) -> Advantages:
    return Advantages(config.algorithm, filter_zero_std=config.filters_zero_std_groups,
                      distill_coef=config.teacher.coef if config.uses_teacher else None)


@dataclass
class Workers:
    """The workers of one process, by the bus task each serves (the Critic serves two tasks)."""

    plan: RolePlan
    by_task: dict[str, Worker]

    @property
    def rollout(self) -> RolloutWorker:
        return self.by_task["rollout"]

    @property
    def actor(self) -> ActorWorker:
        return self.by_task["train"]

    @property
    def reward(self) -> RewardWorker:
        return self.by_task["reward"]

    @property
    def advantages(self) -> AdvantagesWorker:
        return self.by_task["advantages"]

    @property
    def critic(self) -> CriticWorker | None:
        return self.by_task.get("critic")

    def stop(self) -> None:
        """Stop every worker once and release what each holds (the Reward's process pool)."""
        for worker in set(self.by_task.values()):
            worker.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def staleness_gate(config: RunConfig, max_staleness: int) -> StalenessGate:
    return StalenessGate(max_staleness, config.rollout.prompts_per_step)


def prompt_source(config: RunConfig, train_rows: list[PromptRow]) -> PromptSource:
    return PromptSource(PromptStream(train_rows, seed=config.data.seed),
                        staleness_gate(config, config.train.max_staleness))


def rollout_worker(config: RunConfig, plan: RolePlan, rollout: Rollout, bus, source: PromptSource,
                   sync_weights: Callable[[], None], consumer: str = "rollout") -> RolloutWorker:
    r, seed = config.rollout, config.train.seed
    return RolloutWorker(rollout, bus, source, prompt_encoder(config, rollout), r.n,
                         lambda first_group: sampling_params(config, seed=seed * 100_003 + first_group),
                         sync_weights, max_batch_size=r.max_batch_size, fields=plan.outputs("rollout"),
                         refill_dropped=config.algorithm.dynamic_sampling, consumer=consumer,
                         group_fields=plan.group_scoped)


def actor_worker(config: RunConfig, plan: RolePlan, actor: Actor, bus, publish: Callable[[], None],
                 max_staleness: int, max_steps: int | None = None,
                 checkpoints: Checkpointing = NO_CHECKPOINTS) -> ActorWorker:
    r, t, a = config.rollout, config.train, config.algorithm
    rows = r.prompts_per_step * r.n
    return ActorWorker(actor, bus, rows, t.micro_batch_size, staleness_gate(config, max_staleness),
                       fields=plan.inputs("train"), timeout_s=t.step_timeout_s, publish=publish, max_steps=max_steps,
                       final_tasks=plan.final_tasks,
                       dynamic_max_rows=int(rows * a.max_groups_per_step) if a.dynamic_sampling else None,
                       group_size=r.n, checkpoints=checkpoints)


def advantages_worker(config: RunConfig, plan: RolePlan, advantages: Advantages, bus) -> AdvantagesWorker:
    return AdvantagesWorker(advantages, bus, config.rollout.n, plan.inputs("advantages"), plan.outputs("advantages"))


def reward_worker(config: RunConfig, plan: RolePlan, reward: Reward | GenRM, bus) -> RewardWorker:
    unit = "batch" if config.reward.name == "genrm" else config.reward.scope
    return RewardWorker(reward, bus, plan.inputs("reward"), plan.outputs("reward"), unit=unit,
                        group_size=config.rollout.n)


def critic_worker(config: RunConfig, plan: RolePlan, critic: Critic, bus,
                  checkpoints: Checkpointing = NO_CHECKPOINTS) -> CriticWorker:
    r = config.rollout
    return CriticWorker(critic, bus, r.prompts_per_step * r.n, config.train.micro_batch_size, plan.final_tasks,
                        plan.inputs("critic"), plan.inputs("critic_train"), checkpoints)


def logprob_worker(config: RunConfig, plan: RolePlan, task: str, role: Reference, bus,
                   sync_weights: Callable[[], None] = lambda: None) -> LogProbWorker:
    """The worker of a forward-only role (Reference, Teacher, ActorFwd), named after its bus task."""
    return LogProbWorker(task, role, bus, config.train.micro_batch_size, plan.inputs(task), plan.primary_output(task),
                         plan.outputs(task), before_batch=sync_weights)


def build_workers(c: Components, bus, sync_weights: Callable[[], None],
                  publish: Callable[[], None], max_staleness: int) -> Workers:
    """Connect the roles of `c` to `bus`; the callables say how weights travel in this mode."""
    cfg, plan = c.config, c.plan
    by_role: dict[str, Callable[[], Worker]] = {
        "rollout": lambda: rollout_worker(cfg, plan, c.rollout, bus, c.prompts, sync_weights),
        "reward": lambda: reward_worker(cfg, plan, c.reward, bus),
        "genrm": lambda: reward_worker(cfg, plan, c.reward, bus),
        "advantages": lambda: advantages_worker(cfg, plan, c.advantages, bus),
        "reference": lambda: logprob_worker(cfg, plan, "reference", c.reference, bus),
        "critic": lambda: critic_worker(cfg, plan, c.critic, bus),
        "teacher": lambda: logprob_worker(cfg, plan, "teacher", c.teacher, bus),
        "actor": lambda: actor_worker(cfg, plan, c.actor, bus, publish, max_staleness),
    }
    by_task: dict[str, Worker] = {}
    for role in plan.roles:
        worker = by_role[role.name]()
        by_task.update({task: worker for task in role.tasks})
    return Workers(plan, by_task)
