"""R3 end to end inside one process: the hf engine records routes through continuous batching and
KV-cached decode, and the trainer's forwards replay them (tiny Qwen3-MoE, built in code)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlx.agents.trajectory import Trajectory
from rlx.config import AlgorithmConfig, TrainConfig
from rlx.data.sample import Sample
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.engines.training import TrainingEngine, token_logprobs
from rlx.models import eos_token_ids, load_pretrained
from rlx.models.moe import ROUTE_DTYPE, MoeRouting, stack_captured
from rlx.models.tiny import build_tiny
from rlx.roles.actor import Actor
from rlx.roles.batching import samples_to_batch
from tests.integration.stored_samples import train_inputs


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("models") / "tiny-moe", moe_family="qwen3_moe")


def _generate(path, dtype="float32", count=10, batch=4, seed=0):
    model, tokenizer = load_pretrained(path, dtype)
    engine = HFGenerationEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer), tokenizer, batch,
                                record_routes=True)
    prompts = [tokenizer.encode("12+7=abcdefgh"[: 2 + i % 9]) for i in range(count)]
    return engine.generate([GenerationRequest(i, p) for i, p in enumerate(prompts)],
                           SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed)), tokenizer


def _own_routes(model, ids: list[int]) -> torch.Tensor:
    routing = MoeRouting.of(model)
    routing.replay(None)
    with routing.capture() as captured, torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    return stack_captured(captured, 1, len(ids))[0]


def test_the_engine_records_every_computed_position_through_continuous_batching(moe_path, one_thread):
    """10 requests through 4 slots (refills, merges, compaction): each result's routes are those a
    plain full forward of its tokens takes, one per prompt token and per generated token fed back."""
    results, _ = _generate(moe_path)
    model, _ = load_pretrained(moe_path)
    for result in results:
        routes = result.routed_experts
        assert routes.dtype == ROUTE_DTYPE
        assert routes.shape == (len(result.prompt_ids) + len(result.response_ids) - 1, 2, 2)
        full = _own_routes(model, result.prompt_ids + result.response_ids)[: routes.shape[0]]
        assert torch.equal(full.sort(-1).values, routes.sort(-1).values)


def _samples(results) -> list[Sample]:
    return [Sample(uid=r.request_id, group_id=r.request_id // 2, prompt_ids=r.prompt_ids, response_ids=r.response_ids,
                   rollout_logprobs=r.logprobs, routed_experts=r.routed_experts, advantage=(-1.0) ** r.request_id)
            for r in results if r.response_ids]


def test_replay_makes_the_trainer_route_as_a_bf16_engine_did(moe_path, one_thread):
    """A bf16 engine and an fp32 trainer route some tokens differently; with the routes replayed the
    trainer takes exactly the engine's experts and its log-probs move toward the engine's."""
    results, tokenizer = _generate(moe_path, "bfloat16", count=48, batch=8)
    samples = _samples(results)
    model, _ = load_pretrained(moe_path)
    routing = MoeRouting.of(model)
    batch = samples_to_batch(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        with routing.capture() as captured:
            replayed, _ = token_logprobs(model, batch, 1.0)
        used = stack_captured(captured, batch.size, batch.input_ids.shape[1])
        differing, compared = routing.take_mismatch()
        free, _ = token_logprobs(model, dataclasses.replace(batch, routes=None), 1.0)
    recorded = batch.routes >= 0
    assert torch.equal(used[recorded], batch.routes[recorded])
    assert compared == int(recorded.all(-1).sum())
    rollout = torch.zeros_like(replayed)
    for row, sample in enumerate(samples):
        rollout[row, : len(sample.rollout_logprobs)] = torch.tensor(sample.rollout_logprobs)
    mask = batch.response_mask
    gap = lambda logprobs: float(((logprobs - rollout).abs() * mask).sum() / mask.sum())
    print(f"bf16 engine vs fp32 trainer: routes differing {differing}/{compared}, "
          f"|dlogp| replayed {gap(replayed):.5f} free {gap(free):.5f}")
    assert differing > 0, "no route differed: the test would not show replay doing anything"
    assert gap(replayed) < gap(free)


def _actor(path, micro_batch_size: int, every: int, aux: float = 0.0, checkpointing: bool = False) -> Actor:
    model, tokenizer = load_pretrained(path)
    MoeRouting.of(model)
    train = TrainConfig(lr=1e-3, micro_batch_size=micro_batch_size, steps=4, activation_checkpointing=checkpointing)
    engine = TrainingEngine(model, tokenizer, train, 1.0)
    algorithm = AlgorithmConfig(routing_mismatch_every=every, router_aux_loss_coef=aux)
    return Actor(engine, algorithm, tokenizer.pad_token_id, train_inputs(path, algorithm))


def test_a_replayed_step_is_the_same_for_any_micro_batch_size_and_reports_mismatch(moe_path, one_thread):
    results, _ = _generate(moe_path, "bfloat16", count=12, batch=6)
    samples = _samples(results)
    steps = {size: _actor(moe_path, size, every=1).train(samples) for size in (2, len(samples))}
    small, whole = steps[2], steps[len(samples)]
    for key in ("loss", "rollout_logprob_abs_diff", "rollout_logprob_abs_diff_unreplayed", "route_mismatch_fraction"):
        assert small[key] == pytest.approx(whole[key], abs=1e-4), key
    assert 0 < whole["route_mismatch_fraction"] < 1
    assert whole["rollout_logprob_abs_diff"] < whole["rollout_logprob_abs_diff_unreplayed"]
    recomputed = _actor(moe_path, 2, every=1, checkpointing=True).train(samples)  # replayed in backward too
    for key in ("loss", "grad_norm", "route_mismatch_fraction"):
        assert recomputed[key] == pytest.approx(small[key], abs=1e-5), key
    off = _actor(moe_path, len(samples), every=0).train(samples)
    assert "rollout_logprob_abs_diff_unreplayed" not in off  # the extra forward runs only when asked


def test_the_load_balancing_loss_trains_the_routers_from_the_replayed_routes(moe_path, one_thread):
    results, _ = _generate(moe_path, count=8, batch=8)
    samples = [dataclasses.replace(s, advantage=0.0) for s in _samples(results)]  # no policy gradient
    actor = _actor(moe_path, 4, every=0, aux=1.0)
    before = [router.weight.detach().clone() for router in actor._routing.routers]
    metrics = actor.train(samples)
    assert metrics["router_aux_loss"] > 0
    # advantages are all 0: the routers move only through the balancing loss
    assert all(not torch.equal(router.weight, old) for router, old in zip(actor._routing.routers, before))


def test_a_multi_turn_trajectory_keeps_each_position_from_its_first_forward():
    """Turn 2 re-prefills turn 1: positions turn 1 recorded keep their routes (those forwards made
    turn 1's log-probs); the rest (turn 1's last token, the observation, turn 2) come from turn 2."""
    first = torch.full((4 + 3 - 1, 1, 2), 1, dtype=ROUTE_DTYPE)  # prompt 4, turn 3 tokens
    second = torch.full((4 + 3 + 2 + 2 - 1, 1, 2), 2, dtype=ROUTE_DTYPE)  # + observation 2, turn 2 tokens
    trajectory = Trajectory(prompt_ids=[1, 2, 3, 4])
    trajectory.add_policy([5, 6, 7], [-0.1] * 3, version=0, routes=first)
    trajectory.add_observation([8, 9])
    trajectory.add_policy([10, 11], [-0.2] * 2, version=0, routes=second)
    routes = trajectory.routed_experts
    assert routes.shape[0] == len(trajectory.context_ids) - 1
    assert (routes[:6] == 1).all() and (routes[6:] == 2).all()
