"""Pinned loss curves: a silent change to the policy objective or the update fails here.

Training only, on the tiny model, one thread, fixed seed and a fixed set of samples built in code.
The numbers were generated once and pasted in (as torchtune pins its recipes); if an intended
change moves them, regenerate with `RLX_PRINT_CURVE=1` and say why in the commit.
"""

from __future__ import annotations

import os

import pytest
import torch

from rlx.config import AlgorithmConfig
from tests.integration.stored_samples import stored_batch, tiny_actor, with_reference

STEPS = 5


pytestmark = pytest.mark.usefixtures("one_thread")


def run_curve(tiny_path, **train) -> tuple[list[float], list[float], float]:
    """Per-step losses and gradient norms of STEPS Actor steps (cycling over two stored batches), and a
    parameter checksum. On-policy, the first update's loss moves only with the KL: the gradient norms
    and the checksum are what see the policy term."""
    actor = tiny_actor(tiny_path, AlgorithmConfig(kl_coef=0.1), **train)
    batches = [with_reference(stored_batch(i), actor) for i in range(2)]
    metrics = [actor.train(batches[step % 2]) for step in range(STEPS)]
    losses, grad_norms = [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]
    checksum = sum(float((p.detach().double() * torch.linspace(-1, 1, p.numel(), dtype=torch.float64).view_as(p)).sum())
                   + float(p.detach().double().abs().sum()) for p in actor.engine.model.parameters())
    if os.environ.get("RLX_PRINT_CURVE"):
        print(train, [round(v, 7) for v in losses], [round(v, 7) for v in grad_norms], round(checksum, 6))
    return losses, grad_norms, checksum


# generated on the single-update path as it was before PPO epochs existed: it must not move
GRPO_LOSSES = [0.1520991, -0.0075461, 0.1568597, -0.0046361, 0.1627524]
GRPO_GRAD_NORMS = [1.898519, 1.9394418, 1.5416548, 1.5438008, 1.4799212]
GRPO_CHECKSUM = 1854.837025


def test_grpo_clipped_loss_with_kl_curve_is_pinned(tiny_path):
    losses, grad_norms, checksum = run_curve(tiny_path)
    assert losses == pytest.approx(GRPO_LOSSES, abs=1e-4)
    assert grad_norms == pytest.approx(GRPO_GRAD_NORMS, abs=1e-4)
    assert checksum == pytest.approx(GRPO_CHECKSUM, abs=1e-4)


# ppo_epochs=2, mini_batches=2: four updates per step; loss and grad norm are means over them
PPO_LOSSES = [0.0710845, -0.0825828, 0.1000438, -0.0535038, 0.1319642]
PPO_GRAD_NORMS = [1.7380531, 2.1823857, 2.077679, 2.1169326, 1.7900475]
PPO_CHECKSUM = 1932.735728


def test_ppo_epochs_and_mini_batches_curve_is_pinned(tiny_path):
    losses, grad_norms, checksum = run_curve(tiny_path, ppo_epochs=2, mini_batches=2)
    assert losses == pytest.approx(PPO_LOSSES, abs=1e-4)
    assert grad_norms == pytest.approx(PPO_GRAD_NORMS, abs=1e-4)
    assert checksum == pytest.approx(PPO_CHECKSUM, abs=1e-4)
