"""A non-finite loss or gradient skips its update, is counted, and never reaches an engine.

The NaN advantage in these tests is a fault stand-in: it is written in by the test, as a broken
reward, estimator or overflow would, to check what the trainer does with it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlx.bus import LocalBus
from rlx.orchestration.builder import build_components, build_workers
from rlx.orchestration.colocate import train_one_step
from rlx.orchestration.plan import FIELDS
from tests.integration.stored_samples import parameters, stored_batch, tiny_actor
from tests.integration.test_colocate_loop import toy_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _poisoned(samples, index: int = 0):
    """A copy of `samples` whose `index`-th advantage is NaN (the injected fault)."""
    return [dataclasses.replace(s, advantage=math.nan) if i == index else s for i, s in enumerate(samples)]


def test_a_nan_loss_skips_the_update_and_is_counted(tiny_path):
    actor = tiny_actor(tiny_path)
    before = parameters(actor)
    metrics = actor.train(_poisoned(stored_batch(0)))
    assert metrics["nonfinite_skipped"] == 1 and metrics["nonfinite_skipped_total"] == 1
    assert metrics["optimizer_updates"] == 0
    after = parameters(actor)
    assert all(torch.equal(before[name], after[name]) for name in before), "weights must stay the finite ones"
    assert all(p.grad is None for p in actor.engine.model.parameters()), "the NaN gradients are dropped"
    assert not actor.engine.optimizer.state, "AdamW's moments never saw the NaN"
    assert actor.version == 1, "the version counts steps: the same finite weights are published under it"

    clean = actor.train(stored_batch(0))  # the next step trains as if the bad one had not happened
    assert clean["nonfinite_skipped"] == 0 and clean["nonfinite_skipped_total"] == 1
    assert clean["optimizer_updates"] == 1 and not torch.equal(parameters(actor)["lm_head.weight"],
                                                               before["lm_head.weight"])


def test_with_mini_batches_only_the_poisoned_one_is_skipped(tiny_path):
    actor = tiny_actor(tiny_path, ppo_epochs=2, mini_batches=2)
    metrics = actor.train(_poisoned(stored_batch(0), index=3))
    assert metrics["nonfinite_skipped"] == 2, "its mini-batch, once per epoch"
    assert metrics["optimizer_updates"] == 2, "the other mini-batch still trains"
    assert all(torch.isfinite(p).all() for p in actor.engine.model.parameters())


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_colocated_step_with_a_nan_advantage_loads_no_nan_into_the_rollout(tiny_path, tmp_path, epochs):
    config = toy_config(tiny_path, tmp_path, algorithm__filter_zero_std_groups=False, train__ppo_epochs=epochs,
                        train__mini_batches=epochs)
    c = build_components(config)
    with build_workers(c, LocalBus(check_schema=FIELDS), sync_weights=lambda: None, publish=c.sync_weights, max_staleness=0) as workers:
        compute = c.advantages.compute

        def compute_then_poison(samples):
            result = compute(samples)
            samples[0].advantage = math.nan  # the injected fault
            return result

        c.advantages.compute = compute_then_poison
        engine = c.rollout.engine
        before = {name: t.clone() for name, t in engine.model.state_dict().items()}
        metrics = train_one_step(workers, config)
        assert metrics["nonfinite_skipped"] == epochs, "the poisoned (mini-)batch's update, once per epoch"
        assert metrics["optimizer_updates"] == epochs * epochs - epochs
        assert engine.weight_version == 1, "the step's version was loaded"
        actor = c.actor.weights()
        for name, tensor in engine.model.state_dict().items():
            assert torch.isfinite(tensor).all() and torch.equal(tensor, actor[name]), name
            assert torch.equal(tensor, before[name]) == (epochs == 1), f"{name}: only the clean mini-batch trains"
