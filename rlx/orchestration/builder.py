"""Build every component a run needs from its RunConfig."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from rlx.config import RunConfig
from rlx.data import PromptRow, PromptStream, load_splits
from rlx.data.prompts import encode_prompt
from rlx.engines.generation import SamplingParams, build_generation_engine
from rlx.engines.training import TrainingEngine
from rlx.models import eos_token_ids, load_pretrained, resolve_model_path
from rlx.rewards import build_reward
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
