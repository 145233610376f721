"""Pinned loss curves: a silent change to the policy objective or the update fails here.

Training only, on the tiny model, one thread, fixed seed and a fixed set of samples built in code.
The numbers were generated once and pasted in (as torchtune pins its recipes); if an intended
change moves them, regenerate with `RLX_PRINT_CURVE=1` and say why in the commit.
"""

from __future__ import annotations

import os

import pytest
import torch

from rlx.algorithms import grpo_advantages
from rlx.config import AlgorithmConfig, TrainConfig
from rlx.data.sample import Sample
from rlx.engines.training import TrainingEngine
from rlx.models import load_pretrained
from rlx.roles.actor import Actor
from rlx.roles.batching import samples_to_batch

GROUPS, GROUP_SIZE, STEPS = 2, 4, 5


@pytest.fixture()
def one_thread():
    """The pinned numbers hold for one intra-op thread: more threads sum in another order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def stored_batch(index: int, pad_token_id: int) -> list[Sample]:
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


def with_reference(samples: list[Sample], engine: TrainingEngine, pad_token_id: int) -> list[Sample]:
    """KL is taken against the initial policy: score the stored samples with it once."""
    logprobs = engine.outputs(samples_to_batch(samples, pad_token_id))
    for sample, row in zip(samples, logprobs):
        sample.ref_logprobs = row[: len(sample.response_ids)].tolist()
    return samples


def run_curve(tiny_path, **train) -> tuple[list[float], list[float], float]:
    """Per-step losses and gradient norms of STEPS Actor steps (cycling over two stored batches), and a
    parameter checksum. On-policy, the first update's loss moves only with the KL: the gradient norms
    and the checksum are what see the policy term."""
    torch.manual_seed(0)
    model, tokenizer = load_pretrained(tiny_path)
    config = TrainConfig(lr=1e-3, micro_batch_size=3, seed=0, **train)
    engine = TrainingEngine(model, tokenizer, config, temperature=1.0)
    actor = Actor(engine, AlgorithmConfig(kl_coef=0.1), tokenizer.pad_token_id)
    pad = tokenizer.pad_token_id
    batches = [with_reference(stored_batch(i, pad), engine, pad) for i in range(2)]
    metrics = [actor.train(batches[step % 2]) for step in range(STEPS)]
    losses, grad_norms = [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]
    checksum = sum(float((p.detach().double() * torch.linspace(-1, 1, p.numel(), dtype=torch.float64).view_as(p)).sum())
                   + float(p.detach().double().abs().sum()) for p in model.parameters())
    if os.environ.get("RLX_PRINT_CURVE"):
        print(train, [round(v, 7) for v in losses], [round(v, 7) for v in grad_norms], round(checksum, 6),
              repr((losses, grad_norms, checksum)))
    return losses, grad_norms, checksum


GRPO_LOSSES = [0.1520991, -0.0075461, 0.1568597, -0.0046361, 0.1627524]
GRPO_GRAD_NORMS = [1.898519, 1.9394418, 1.5416548, 1.5438008, 1.4799212]
GRPO_CHECKSUM = 1854.837025


def test_grpo_clipped_loss_with_kl_curve_is_pinned(tiny_path, one_thread):
    losses, grad_norms, checksum = run_curve(tiny_path)
    assert losses == pytest.approx(GRPO_LOSSES, abs=1e-4)
    assert grad_norms == pytest.approx(GRPO_GRAD_NORMS, abs=1e-4)
    assert checksum == pytest.approx(GRPO_CHECKSUM, abs=1e-4)
