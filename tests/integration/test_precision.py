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
    assert _dtype(build_actor_fwd(config, tiny_path).model) == torch.bfloat16
    actor = build_actor(config, tiny_path)
    assert _dtype(actor.engine.model) == torch.float32  # master weights
    assert actor.engine.config.bf16_autocast


def test_float32_by_default(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, algorithm__kl_coef=0.05)
    assert _dtype(build_rollout(config, tiny_path).engine.model) == torch.float32
    assert _dtype(build_reference(config, tiny_path).model) == torch.float32
    assert not build_actor(config, tiny_path).engine.config.bf16_autocast
