"""Decoupled PPO plumbing: ActorFwd writes proximal log-probs to the bus, the Actor trains against them."""

from __future__ import annotations

import pytest

from rlx.bus import LocalBus
from rlx.orchestration.builder import (
    actor_worker,
    build_actor,
    build_actor_fwd,
    build_components,
    build_workers,
    logprob_worker,
)
from rlx.orchestration.plan import FIELDS, build_plan
from tests.integration.test_colocate_loop import toy_config


def test_actor_fwd_log_probs_drive_the_ratio(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, algorithm__behavior_correction="decoupled")
    c = build_components(config)
    bus = LocalBus(check_schema=FIELDS)
    with build_workers(c, bus, sync_weights=lambda: None, publish=c.sync_weights, max_staleness=0) as workers:
        async_config = config.model_copy(update={"train": config.train.model_copy(update={"mode": "async"})})
        async_plan = build_plan(async_config)
        assert async_plan.has("actor_fwd") and not c.plan.has("actor_fwd")  # colocated mode has no proximal lag
        actor_fwd = build_actor_fwd(config, tiny_path)
        fwd = logprob_worker(config, async_plan, "actor_fwd", actor_fwd, bus)
        # an Actor of the async run (its plan gives the train task ActorFwd's log-probs), publishing to the rollout
        actor = build_actor(async_config, tiny_path)
        trainer = actor_worker(config, async_plan, actor, bus, max_staleness=0,
                               publish=lambda: c.rollout.load_weights(actor.weights(), actor.version))

        workers.rollout.generate(config.rollout.prompts_per_step)
        workers.reward.drain()
        workers.advantages.drain()
        assert fwd.drain() == 32  # every sample gets proximal log-probs, filtered or not
        same = trainer.train_step()
        # ActorFwd held the trainer's weights when it scored these samples: the ratio is exactly 1
        assert same["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert same["proximal_staleness_mean"] == 0.0  # computed with version 0, trained at version 0

        workers.rollout.generate(config.rollout.prompts_per_step)  # the next step: the trainer has moved on,
        workers.reward.drain()                                     # ActorFwd still holds the initial weights
        workers.advantages.drain()
        fwd.drain()
        metrics = trainer.train_step()
        assert abs(metrics["ratio_mean"] - 1.0) > 1e-3, "the ratio must be taken against ActorFwd's log-probs"
        assert metrics["proximal_staleness_mean"] == 1.0  # ActorFwd's version 0 against the trainer's 1
        assert metrics["trained_samples"] + metrics.get("filtered_zero_std_group", 0) == 32
        assert metrics["grad_norm"] > 0
