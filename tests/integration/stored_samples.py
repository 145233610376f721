"""A fixed, seeded set of GRPO samples and an Actor on the tiny model, for training-only tests."""

from __future__ import annotations

import torch

from rlx.algorithms import grpo_advantages
from rlx.config import AlgorithmConfig, RunConfig, TrainConfig
from rlx.data.sample import Sample
from rlx.engines.training import TrainingEngine
from rlx.models import load_pretrained
from rlx.orchestration.plan import build_plan
from rlx.roles.actor import Actor
from rlx.roles.batching import samples_to_batch

GROUPS, GROUP_SIZE = 2, 4


def stored_batch(index: int) -> list[Sample]:
    """Two groups of four responses with seeded tokens and rewards, GRPO advantages, uid order scrambled."""
    gen = torch.Generator().manual_seed(1000 + index)
    samples = []
    for group in range(GROUPS):
        prompt = torch.randint(5, 90, (4 + 3 * group,), generator=gen).tolist()
        for member in range(GROUP_SIZE):
            length = int(torch.randint(3, 12, (1,), generator=gen))
            samples.append(Sample(uid=(7 * len(samples) + 3 * index) % 17 + 100 * index, group_id=group,
                                  prompt_ids=prompt, response_ids=torch.randint(5, 90, (length,), generator=gen).tolist(),
                                  reward=float(member % 2 == group % 2) + 0.25 * member))
    advantages = grpo_advantages(torch.tensor([s.reward for s in samples]), torch.tensor([s.group_id for s in samples]))
    for sample, advantage in zip(samples, advantages.tolist()):
        sample.advantage = advantage
    return samples


def with_reference(samples: list[Sample], actor: Actor) -> list[Sample]:
    """KL is taken against the initial policy: score the stored samples with it once, before training."""
    logprobs = actor.engine.outputs(samples_to_batch(samples, actor.pad_token_id))
    for sample, row in zip(samples, logprobs):
        sample.ref_logprobs = row[: len(sample.response_ids)].tolist()
    return samples


def tiny_actor(tiny_path, algorithm: AlgorithmConfig | None = None, **train) -> Actor:
    """A fresh Actor on the tiny model: lr 1e-3, micro-batches of 3 unless `train` says otherwise."""
    torch.manual_seed(0)
    model, tokenizer = load_pretrained(tiny_path)
    config = TrainConfig(**{"lr": 1e-3, "micro_batch_size": 3, "seed": 0, **train})
    algorithm = algorithm or AlgorithmConfig()
    return Actor(TrainingEngine(model, tokenizer, config, temperature=1.0), algorithm, tokenizer.pad_token_id,
                 train_inputs(tiny_path, algorithm))


def train_inputs(model_path, algorithm: AlgorithmConfig) -> list[str]:
    """The bus fields the train task reads in a run of `algorithm`, as the role plan says."""
    return build_plan(RunConfig(model={"path": str(model_path)}, algorithm=algorithm)).inputs("train")


def parameters(actor: Actor) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in actor.engine.model.named_parameters()}
