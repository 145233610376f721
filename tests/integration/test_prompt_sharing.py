"""Rows that share a prompt run it once (`train.share_prompts`): packed or through a KV cache, the
same log-probs, entropies and gradients as one forward over whole padded sequences, and the plain
forward wherever neither applies."""

from __future__ import annotations

import pytest
import torch

import rlx.engines.attention  # noqa: F401  (registers rlx's CPU attention kernel)
from rlx.engines.training import collate, token_logprobs
from rlx.engines.training.forward import forward_logits
from rlx.engines.training.prompt_sharing import cached_logits, packs, prompt_groups
from rlx.models.moe import MoeRouting
from rlx.models.tiny import tiny_model, tiny_moe_model

VOCAB = 40
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]  # left padding differs per prompt


def _batch(group_size: int = 3, response_lengths: tuple[int, ...] = (1, 4, 2, 6, 3, 5, 2, 1, 4)):
    """Groups of `group_size` rows per prompt, responses of uneven lengths (right padding)."""
    prompts = [p for p in PROMPTS for _ in range(group_size)]
    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, VOCAB, (response_lengths[i % len(response_lengths)],), generator=generator).tolist()
                 for i in range(len(prompts))]
    return collate(prompts, responses, pad_token_id=0)


def _logprobs_and_grads(model, batch, share: bool, bf16: bool = False):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = token_logprobs(model, batch, temperature=0.7, with_entropy=True, bf16=bf16,
                                       share_prompts=share)
    (logprobs * batch.response_mask).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    mask = batch.response_mask.bool()
    return logprobs.detach()[mask], entropy.detach()[mask], grads


def _assert_same(plain, shared, atol=1e-5):
    assert torch.allclose(plain[0], shared[0], atol=atol)
    assert torch.allclose(plain[1], shared[1], atol=atol)
    assert ((plain[2] - shared[2]).norm() / plain[2].norm()) < atol


@pytest.mark.parametrize("attention", ["sdpa", "eager", "rlx_grouped_sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_packed_rows_give_the_same_logprobs_and_gradients(family, attention):
    model = tiny_model(VOCAB) if family == "llama" else tiny_moe_model(family, VOCAB)
    model.set_attn_implementation(attention)
    batch = _batch()
    assert packs(model) and prompt_groups(model, batch) is not None
    _assert_same(_logprobs_and_grads(model, batch, share=False), _logprobs_and_grads(model, batch, share=True))


def test_packing_holds_under_activation_checkpointing():
    model = tiny_model(VOCAB)
    batch = _batch()
    plain = _logprobs_and_grads(model, batch, share=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert prompt_groups(model, batch) is not None
    _assert_same(plain, _logprobs_and_grads(model, batch, share=True))


def test_cached_prompts_give_the_same_logits_and_gradients():
    """The KV-cache way, taken where packing cannot be (other attention kernels, sliding windows)."""
    model = tiny_model(VOCAB)
    batch = _batch()
    outputs = []
    for shared in (False, True):
        model.zero_grad(set_to_none=True)
        if shared:
            logits = cached_logits(model, batch, *prompt_groups(model, batch))
        else:
            logits = forward_logits(model, batch, False, logits_to_keep=batch.response_width + 1)[:, :-1]
        picked = logits[batch.response_mask.bool()]
        picked.logsumexp(-1).sum().backward()
        outputs.append((picked.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert torch.allclose(outputs[0][0], outputs[1][0], atol=1e-5)
    assert ((outputs[0][1] - outputs[1][1]).norm() / outputs[0][1].norm()) < 1e-5


def test_one_token_responses():
    model = tiny_model(VOCAB)
    batch = _batch(response_lengths=(1,))
    assert batch.response_width == 1
    _assert_same(_logprobs_and_grads(model, batch, False), _logprobs_and_grads(model, batch, True))
    first = cached_logits(model, batch, *prompt_groups(model, batch))
    assert torch.allclose(first, forward_logits(model, batch, False, logits_to_keep=2)[:, :-1], atol=1e-5)


def test_bf16_autocast_stays_close():
    model = tiny_model(VOCAB)
    batch = _batch()
    plain, shared = _logprobs_and_grads(model, batch, False, bf16=True), _logprobs_and_grads(model, batch, True, bf16=True)
    assert (plain[0] - shared[0]).abs().max() < 0.05  # bf16 rounds each path's matmuls differently


def _packed_shapes(model, batch) -> list[tuple[int, ...]]:
    shapes = []
    hook = model.model.embed_tokens.register_forward_hook(lambda _m, args, _o: shapes.append(tuple(args[0].shape)))
    with torch.no_grad():
        token_logprobs(model, batch, share_prompts=True)
    hook.remove()
    return shapes


def test_each_distinct_prompt_runs_once_without_padding():
    model = tiny_model(VOCAB)
    batch = _batch(group_size=4)
    first_rows, row_prompt = prompt_groups(model, batch)
    assert sorted(first_rows.tolist()) == [0, 4, 8]
    assert row_prompt.tolist() == [row_prompt[0]] * 4 + [row_prompt[4]] * 4 + [row_prompt[8]] * 4
    responses = int(batch.attention_mask[:, -batch.response_width:].sum())
    assert _packed_shapes(model, batch) == [(1, sum(map(len, PROMPTS)) + responses)]  # one sequence, no padding


def test_blocks_beyond_the_packed_length_take_sequences_of_their_own(monkeypatch):
    import rlx.engines.training.prompt_sharing as sharing

    model = tiny_model(VOCAB)
    batch = _batch(group_size=4)
    plain = _logprobs_and_grads(model, batch, share=False)
    monkeypatch.setattr(sharing, "PACKED_TOKENS", 1)
    widest = max(len(p) + int(batch.attention_mask[4 * i : 4 * i + 4, -batch.response_width:].sum())
                 for i, p in enumerate(PROMPTS))
    assert _packed_shapes(model, batch) == [(3, widest)]
    _assert_same(plain, _logprobs_and_grads(model, batch, share=True))


def test_first_fit_fills_the_largest_first():
    from rlx.engines.training.prompt_sharing import _first_fit

    assert _first_fit([5, 9, 3, 4], 10) == [[1], [0, 3], [2]]
    assert _first_fit([5, 9, 3, 4], 30) == [[1, 0, 3, 2]]


def test_plain_or_cached_forward_where_packing_cannot_apply():
    model = tiny_model(VOCAB)
    assert prompt_groups(model, _batch(group_size=1)) is None  # no two rows share a prompt
    batch = _batch()
    batch.routes = torch.zeros(batch.size, batch.input_ids.shape[1], 2, 2, dtype=torch.int16)
    assert prompt_groups(model, batch) is None  # R3 replays routes over every column
    moe = tiny_moe_model("qwen3_moe", VOCAB)
    MoeRouting.of(moe)
    assert prompt_groups(moe, _batch()) is None  # routing replay installed: even a batch without routes
    model.config.sliding_window = 4  # a sliding window: the custom mask would override it
    assert not packs(model) and prompt_groups(model, _batch()) is not None  # the cached way still applies
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert prompt_groups(model, _batch()) is None  # and not under activation checkpointing


def test_blocks_too_long_to_pack_take_the_cached_way(monkeypatch):
    import rlx.engines.training.prompt_sharing as sharing

    model = tiny_model(VOCAB)
    batch = _batch()
    plain = _logprobs_and_grads(model, batch, share=False)
    monkeypatch.setattr(sharing, "MAX_PACKED_BLOCK", 8)
    calls = []
    monkeypatch.setattr(sharing, "cached_logits", lambda *args: calls.append(1) or cached_logits(*args))
    _assert_same(plain, _logprobs_and_grads(model, batch, share=True))
    assert calls == [1]
