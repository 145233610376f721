"""Training engine: micro-batch invariance, PPO epochs and mini-batches, checkpoints, HF export."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.algorithms.aggregate import aggregate
from rlx.config import AlgorithmConfig, TrainConfig
from rlx.engines.training import TrainingEngine, collate
from rlx.models import load_pretrained
from tests.integration.stored_samples import parameters, stored_batch, tiny_actor, with_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(tokenizer, rows=6):
    torch.manual_seed(0)
    prompts = [tokenizer(f"prompt {i} " * (i + 1), add_special_tokens=False)["input_ids"] for i in range(rows)]
    responses = [torch.randint(5, 90, (3 + 2 * i,)).tolist() for i in range(rows)]
    advantages = [[float(i % 3) - 1.0] * len(r) for i, r in enumerate(responses)]
    return collate(prompts, responses, tokenizer.pad_token_id, per_token={"advantages": advantages})


def _loss_fn(mode, global_tokens, global_sequences):
    def loss_fn(mb, logprobs, entropy):
        per_token = -logprobs * mb.per_token["advantages"]
        return aggregate(per_token, mb.response_mask, mode, global_tokens, global_sequences), {}
    return loss_fn


def _grads_after_step(tiny_path, tokenizer, micro_batch_size, mode):
    model, _ = load_pretrained(tiny_path)
    engine = TrainingEngine(model, tokenizer, TrainConfig(micro_batch_size=micro_batch_size, grad_clip=1e9), 1.0)
    batch = _batch(tokenizer)
    engine.train_step(batch, _loss_fn(mode, float(batch.response_mask.sum()), float(batch.size)))
    return {n: p.grad.clone() for n, p in model.named_parameters()}, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_micro_batch_size_leaves_gradient_and_update_unchanged(tiny, tiny_path):
    _, tokenizer = tiny
    for mode in ("token-mean", "seq-mean-token-mean"):
        grads_full, params_full = _grads_after_step(tiny_path, tokenizer, 6, mode)
        for size in (1, 4):
            grads, params = _grads_after_step(tiny_path, tokenizer, size, mode)
            for name in grads_full:
                assert torch.allclose(grads[name], grads_full[name], atol=1e-6, rtol=1e-4), (mode, size, name)
                assert torch.allclose(params[name], params_full[name], atol=1e-6), (mode, size, name)


def test_engine_logprobs_match_across_micro_batches(tiny, tiny_path):
    model, tokenizer = tiny
    batch = _batch(tokenizer)
    one = TrainingEngine(model, tokenizer, TrainConfig(micro_batch_size=1), 1.0).outputs(batch)
    all_rows = TrainingEngine(model, tokenizer, TrainConfig(micro_batch_size=6), 1.0).outputs(batch)
    mask = batch.response_mask.bool()
    assert torch.allclose(one[mask], all_rows[mask], atol=1e-5)


def test_checkpoint_round_trip_and_export(tiny, tiny_path, tmp_path):
    model, tokenizer = tiny
    config = TrainConfig(micro_batch_size=3, lr=1e-3, warmup_steps=2)
    engine = TrainingEngine(model, tokenizer, config, 1.0)
    batch = _batch(tokenizer)
    loss = _loss_fn("token-mean", float(batch.response_mask.sum()), float(batch.size))
    engine.train_step(batch, loss)
    engine.save_checkpoint(tmp_path / "ckpt", {"data_position": 17})

    restored_model, _ = load_pretrained(tiny_path)
    restored = TrainingEngine(restored_model, tokenizer, config, 1.0)
    state = restored.load_checkpoint(tmp_path / "ckpt")
    assert state == {"data_position": 17} and restored.step == 1
    assert restored.scheduler.get_last_lr() == engine.scheduler.get_last_lr()
    # the next step from the restored engine equals the next step of the original (optimizer state kept)
    engine.train_step(batch, loss)
    restored.train_step(batch, loss)
    for (name, a), b in zip(model.named_parameters(), restored_model.parameters()):
        assert torch.allclose(a, b, atol=1e-7), name

    exported = engine.export(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(exported)
    for (name, a), b in zip(model.named_parameters(), reloaded.parameters()):
        assert torch.equal(a, b), name
    assert (exported / "tokenizer.json").exists()


def _ppo_step(tiny_path, shuffle: bool = False, **train) -> tuple[dict[str, torch.Tensor], dict[str, float], int]:
    """One Actor step with KL over 16 stored samples, fed in uid-scrambled (or shuffled) order."""
    actor = tiny_actor(tiny_path, AlgorithmConfig(kl_coef=0.1), **train)
    samples = with_reference(stored_batch(0) + stored_batch(1), actor)
    if shuffle:
        random.Random(1).shuffle(samples)
    metrics = actor.train(samples)
    return parameters(actor), metrics, actor.version


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def test_ppo_epochs_and_mini_batches_are_micro_batch_invariant(tiny_path):
    # lr 1e-4: Adam's first updates are nearly sign(g) * lr, so rounding noise in a gradient near 0
    # can move a weight by up to lr; at this lr that stays under 1e-6 while a real difference (a
    # mini-batch scaled by the wrong count, membership that follows micro-batching) moves ~1e-4.
    initial = parameters(tiny_actor(tiny_path))
    reference, metrics, version = _ppo_step(tiny_path, micro_batch_size=4, ppo_epochs=2, mini_batches=2, lr=1e-4)
    assert metrics["optimizer_updates"] == 4 and version == 1, "one version per step, four updates in it"
    assert _max_difference(reference, initial) > 5e-5, "the step must move the weights well past the tolerance"
    for size in (1, 2):
        params, _, _ = _ppo_step(tiny_path, micro_batch_size=size, ppo_epochs=2, mini_batches=2, lr=1e-4)
        assert _max_difference(params, reference) < 1e-6, size


def test_the_clip_acts_from_the_second_update_on(tiny_path):
    _, one, _ = _ppo_step(tiny_path, micro_batch_size=4)
    assert one["clip_fraction"] == 0.0 and one["ratio_mean"] == pytest.approx(1.0, abs=1e-6), "on-policy"
    # epoch 1 has the old log-probs' weights: its ratio is 1, so any clipping is epoch 2's
    _, two, _ = _ppo_step(tiny_path, micro_batch_size=4, ppo_epochs=2)
    assert two["optimizer_updates"] == 2
    assert two["clip_fraction"] > 0.05, "the second update starts from moved weights: the clip must act"
    assert two["ratio_mean"] != pytest.approx(1.0, abs=1e-3)


def test_mini_batch_membership_ignores_arrival_order(tiny_path):
    ordered, _, _ = _ppo_step(tiny_path, micro_batch_size=3, ppo_epochs=2, mini_batches=2)
    shuffled, _, _ = _ppo_step(tiny_path, shuffle=True, micro_batch_size=3, ppo_epochs=2, mini_batches=2)
    for name in ordered:
        assert torch.equal(ordered[name], shuffled[name]), name


def test_lr_schedule_advances_once_per_step_whatever_the_updates(tiny_path):
    actor = tiny_actor(tiny_path, lr=1e-3, warmup_steps=4, ppo_epochs=3, mini_batches=2)
    samples = stored_batch(0)
    lrs = [actor.train(samples)["lr"] for _ in range(2)]
    assert lrs == pytest.approx([0.25e-3, 0.5e-3]), "warm-up counts steps, not optimizer updates"
    assert actor.version == 2 and actor.engine.updates == 12


def test_the_actor_takes_the_loss_inputs_the_role_plan_gives_the_train_task(tiny_path):
    with_kl = tiny_actor(tiny_path, AlgorithmConfig(kl_coef=0.1))  # its plan has a reference: ref_logprobs
    with pytest.raises(ValueError, match=r"the train task reads 'ref_logprobs' \(the role plan says so\)"):
        with_kl.train(stored_batch(0))  # samples without the reference's log-probs
    assert "ref_logprobs" in with_kl._batch(with_reference(stored_batch(0), with_kl)).per_token
    without = tiny_actor(tiny_path)  # no reference in its plan: samples that carry them train without them
    assert "ref_logprobs" not in without._batch(with_reference(stored_batch(0), without)).per_token
