"""Build every component a run needs from its RunConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import PreTrainedTokenizerBase

from rlx.config import RunConfig
from rlx.data import PromptRow, PromptStream, load_splits
from rlx.data.prompts import encode_prompt
from rlx.engines.generation import SamplingParams, build_generation_engine
from rlx.engines.training import TrainingEngine
from rlx.models import eos_token_ids, load_pretrained, resolve_model_path
from rlx.rewards import build_reward
from rlx.orchestration.staleness import StalenessGate
from rlx.orchestration.workers import (
    ActorWorker, AdvantagesWorker, ReferenceWorker, RewardWorker, RolloutWorker, Worker,
)
from rlx.roles import Actor, Advantages, Reference, Reward, Rollout


@dataclass
class Components:
    config: RunConfig
    tokenizer: PreTrainedTokenizerBase
    rollout: Rollout
    reward: Reward
    advantages: Advantages
    actor: Actor
    reference: Reference | None
    train_stream: PromptStream
    eval_rows: list[PromptRow]

    def encode(self, row: PromptRow) -> list[int]:
        data = self.config.data
        return encode_prompt(row, self.tokenizer, data.system_prompt, data.apply_chat_template, data.max_prompt_tokens)

    def sampling(self, seed: int | None, greedy: bool = False) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(
            temperature=0.0 if greedy else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop=tuple(r.stop),
            seed=seed,
        )

    def sync_weights(self) -> None:
        """Colocated weight hand-off: copy the trainer's weights into the generation engine."""
        self.rollout.load_weights(self.actor.weights(), self.actor.version)


def build_components(config: RunConfig) -> Components:
    if config.resources.num_threads:
        torch.set_num_threads(config.resources.num_threads)
    torch.manual_seed(config.train.seed)
    train_rows, eval_rows = load_splits(config.data)  # bad data fails here, before any model loads
    reward_fn = build_reward(config.reward.name, config.reward.extract)
    path = resolve_model_path(config.model.path)
    device = config.resources.device
    policy, tokenizer = load_pretrained(path, "float32", device)
    sampler_model, _ = load_pretrained(path, config.model.dtype, device)
    engine = build_generation_engine(
        config.rollout.engine,
        model=sampler_model,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=eos_token_ids(sampler_model, tokenizer),
        tokenizer=tokenizer,
        max_batch_size=config.rollout.max_batch_size,
    )
    temperature = config.rollout.temperature
    training = TrainingEngine(policy, tokenizer, config.train, temperature)
    reference = None
    if config.algorithm.kl_coef > 0:
        ref_model, _ = load_pretrained(path, config.model.dtype, device)
        reference = Reference(ref_model, tokenizer.pad_token_id, temperature, config.train.micro_batch_size)
    return Components(
        config=config,
        tokenizer=tokenizer,
        rollout=Rollout(engine, tokenizer),
        reward=Reward(reward_fn),
        advantages=Advantages(config.algorithm),
        actor=Actor(training, config.algorithm, tokenizer.pad_token_id),
        reference=reference,
        train_stream=PromptStream(train_rows, seed=config.data.seed),
        eval_rows=eval_rows,
    )


@dataclass
class Workers:
    rollout: RolloutWorker
    reward: RewardWorker
    advantages: AdvantagesWorker
    reference: ReferenceWorker | None
    actor: ActorWorker

    def all(self) -> list[Worker]:
        return [w for w in (self.rollout, self.reward, self.advantages, self.reference, self.actor) if w is not None]


def build_workers(c: Components, bus, trainer_version: Callable[[], int], sync_weights: Callable[[], None],
                  publish: Callable[[], None], max_staleness: int) -> Workers:
    """Connect the roles of `c` to `bus`; the callables say how weights travel in this mode."""
    r, t = c.config.rollout, c.config.train
    gate = StalenessGate(max_staleness, r.prompts_per_step)
    return Workers(
        rollout=RolloutWorker(c.rollout, bus, c.train_stream, c.encode, r.n,
                              lambda started: c.sampling(seed=t.seed * 100_003 + started), gate, trainer_version,
                              sync_weights, wave_groups=max(1, r.max_batch_size // r.n)),
        reward=RewardWorker(c.reward, bus),
        advantages=AdvantagesWorker(c.advantages, bus, group_size=r.n),
        reference=ReferenceWorker(c.reference, bus, t.micro_batch_size) if c.reference is not None else None,
        actor=ActorWorker(c.actor, bus, r.prompts_per_step * r.n, t.micro_batch_size, gate,
                          with_reference=c.reference is not None, timeout_s=t.step_timeout_s, publish=publish),
    )
