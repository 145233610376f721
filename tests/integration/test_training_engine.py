"""Training engine: micro-batch invariance, checkpoints, Hugging Face export."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rlx.algorithms.aggregate import aggregate
from rlx.config import TrainConfig
from rlx.engines.training import TrainingEngine, collate
from rlx.models import load_pretrained


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
