"""Each precision key reaches the roles it names: rollout.dtype the generation engine,
train.param_dtype the forward-only scorers (Reference, ActorFwd) and the trainer's autocast,
whose master weights stay float32."""

from __future__ import annotations

import torch

from rlx.orchestration.builder import build_actor, build_actor_fwd, build_reference, build_rollout
from tests.integration.test_colocate_loop import toy_config


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def test_precision_keys_reach_their_roles(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, rollout__dtype="bfloat16", train__param_dtype="bfloat16",
                        algorithm__kl_coef=0.05)
    assert _dtype(build_rollout(config, tiny_path).engine.model) == torch.bfloat16
    assert _dtype(build_reference(config, tiny_path).model) == torch.bfloat16
    actor_fwd = build_actor_fwd(config, tiny_path)
    assert _dtype(actor_fwd.model) == torch.float32 and actor_fwd.bf16  # the Actor's numerics
    actor = build_actor(config, tiny_path)
    assert _dtype(actor.engine.model) == torch.float32  # master weights
    assert actor.engine.config.bf16_autocast


def test_float32_by_default(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, algorithm__kl_coef=0.05)
    assert _dtype(build_rollout(config, tiny_path).engine.model) == torch.float32
    assert _dtype(build_reference(config, tiny_path).model) == torch.float32
    assert not build_actor(config, tiny_path).engine.config.bf16_autocast


def test_actor_fwd_scores_with_the_actors_own_numerics_under_bf16(tiny_path, tmp_path):
    from rlx.data.sample import Sample
    from rlx.engines.training.forward import token_logprobs
    from rlx.roles.batching import samples_to_batch

    config = toy_config(tiny_path, tmp_path, train__param_dtype="bfloat16")
    actor, actor_fwd = build_actor(config, tiny_path), build_actor_fwd(config, tiny_path)
    samples = [Sample(uid=i, group_id=0, prompt_ids=[5, 6, 7][: i + 1], response_ids=[8, 9, 10, 11]) for i in range(3)]
    trainer, _ = token_logprobs(actor.engine.model, samples_to_batch(samples, 0), config.rollout.temperature, bf16=True)
    proximal = actor_fwd.logprobs(samples)
    for sample, row, scored in zip(samples, trainer, proximal):
        assert row[: len(sample.response_ids)].tolist() == scored  # the proximal ratio is exactly 1
