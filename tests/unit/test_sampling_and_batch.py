"""Unit tests for token filtering/sampling, token-batch layout and LR schedules."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rlx.engines.generation.base import SamplingParams
from rlx.engines.generation.hf import draw, filter_logits, sample_next
from rlx.engines.training.batch import TokenBatch, collate
from rlx.engines.training.schedule import lr_multiplier

# ------------------------------------------------------------------------------------- filtering


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(out).sum(-1).tolist() == [2, 2]
    assert torch.isfinite(out[0]).nonzero().squeeze(-1).tolist() == [1, 3]
    assert torch.isfinite(out[1]).nonzero().squeeze(-1).tolist() == [0, 1]
    kept = torch.isfinite(out)
    assert torch.equal(out[kept], logits[kept])  # surviving logits are unchanged


def test_top_k_random_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=gen)
    for k in (1, 3, 49):
        out = filter_logits(logits, top_k=k, top_p=1.0)
        assert (torch.isfinite(out).sum(-1) == k).all()
        assert torch.equal(out.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("k", [0, 5, 100])
def test_top_k_disabled_or_too_large_is_identity(k):
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5]])
    assert torch.equal(filter_logits(logits, top_k=k, top_p=1.0), logits)


def test_top_p_half_keeps_only_the_head():
    # probs [.6, .3, .1]: mass before each sorted token = [0, .6, .9]; >= .5 drops the 2nd and 3rd
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    out = filter_logits(logits, top_k=0, top_p=0.5)
    assert torch.isfinite(out).tolist() == [[True, False, False]]
    # same distribution, shuffled: the kept token follows the probability, not the column
    shuffled = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    assert torch.isfinite(filter_logits(shuffled, 0, 0.5)).tolist() == [[False, True, False]]


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    # probs [.6, .3, .1], top_p=.8: mass before .3 is .6 < .8 -> kept; before .1 is .9 -> dropped
    logits = torch.log(torch.tensor([[0.3, 0.1, 0.6]]))
    out = filter_logits(logits, top_k=0, top_p=0.8)
    assert torch.isfinite(out).tolist() == [[True, False, True]]
    # a tiny top_p still keeps the most likely token
    assert torch.isfinite(filter_logits(logits, 0, 1e-6)).tolist() == [[False, False, True]]


def test_top_k_then_top_p_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    out = filter_logits(logits, top_k=3, top_p=0.7)
    # row 0 after top-3: renormalised [.526, .316, .158]; mass before = [0, .526, .842] -> keep 2
    # row 1 all equal: top-k keeps every tie (4); masses before [0, .25, .5, .75] -> keep 3
    assert torch.isfinite(out).sum(-1).tolist() == [2, 3]


# -------------------------------------------------------------------------------------- sampling


def test_greedy_picks_argmax_with_temperature_one_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]])
    tokens, logprobs = sample_next(logits, SamplingParams(temperature=0.0), None)
    assert tokens.tolist() == [1, 2]
    expected = torch.log_softmax(logits, -1)[torch.arange(2), tokens]
    torch.testing.assert_close(logprobs, expected)
    # hand value row 0: 3 - log(e^1 + e^3 + e^2) = -0.407606
    assert logprobs[0].item() == pytest.approx(-0.407606, abs=1e-5)


def test_sampled_logprobs_are_temperature_scaled_and_unfiltered():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 10, generator=gen) * 2
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.5, top_k=3, top_p=0.9)):
        tokens, logprobs = sample_next(logits, params, torch.Generator().manual_seed(1))
        expected = torch.log_softmax(logits / params.temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs, expected)
        assert logprobs.dtype == torch.float32
        if params.top_k:
            top3 = torch.topk(logits, 3, -1).indices
            assert (top3 == tokens[:, None]).any(-1).all()


def test_sampling_is_reproducible_with_a_seeded_generator():
    logits = torch.zeros(32, 50)
    params = SamplingParams(temperature=1.0)
    a, _ = sample_next(logits, params, torch.Generator().manual_seed(7))
    b, _ = sample_next(logits, params, torch.Generator().manual_seed(7))
    c, _ = sample_next(logits, params, torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_one_sampling_is_argmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 20, generator=gen)
    params = SamplingParams(temperature=2.0, top_k=1)
    for seed in range(5):
        tokens, _ = sample_next(logits, params, torch.Generator().manual_seed(seed))
        assert torch.equal(tokens, logits.argmax(-1))


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).expand(20000, 3)
    tokens, _ = sample_next(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    # binomial std at n=20000 is <= .0035; allow ~5 sigma
    torch.testing.assert_close(freq, probs, atol=0.02, rtol=0)


def test_zero_probability_tokens_are_never_drawn():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0]).expand(20000, 5)
    tokens = draw(probs, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {1, 3}
    # the extreme draws: a uniform of 0 takes the first token with mass, one of nearly 1 the last
    assert draw(torch.tensor([[0.0, 0.0, 1.0, 0.0]]), None).item() == 2
    lone = torch.tensor([[0.0, 1.0, 0.0]])
    for seed in range(50):
        assert draw(lone, torch.Generator().manual_seed(seed)).item() == 1


def test_bf16_logits_are_upcast():
    logits = torch.tensor([[1.0, 2.0, 0.5]], dtype=torch.bfloat16)
    tokens, logprobs = sample_next(logits, SamplingParams(temperature=0.0), None)
    assert tokens.item() == 1 and logprobs.dtype == torch.float32


# --------------------------------------------------------------------------------------- collate


PAD = 0


@pytest.fixture
def batch() -> TokenBatch:
    # P = 3 (longest prompt), R = 4 (longest response)
    return collate(
        prompts=[[1, 2, 3], [4], [5, 6]],
        responses=[[11, 12], [13, 14, 15, 16], [17]],
        pad_token_id=PAD,
        loss_masks=[[1.0, 0.0], [0.0, 1.0, 1.0, 1.0], [1.0]],
        per_token={"advantages": [[0.5, 0.5], [-1.0, -1.0, -1.0, -1.0], [2.0]]},
        per_sequence={"reward": [1.0, 0.0, 0.5]},
    )


def test_collate_layout(batch):
    assert batch.input_ids.tolist() == [
        [1, 2, 3, 11, 12, PAD, PAD],
        [PAD, PAD, 4, 13, 14, 15, 16],
        [PAD, 5, 6, 17, PAD, PAD, PAD],
    ]
    assert batch.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1, 1],
        [0, 1, 1, 1, 0, 0, 0],
    ]
    assert batch.response_ids.tolist() == [[11, 12, PAD, PAD], [13, 14, 15, 16], [17, PAD, PAD, PAD]]
    assert batch.size == 3 and batch.response_width == 4
    # every response starts in column P = 3
    assert torch.equal(batch.input_ids[:, 3:], batch.response_ids)
    assert batch.response_mask.tolist() == [[1, 0, 0, 0], [0, 1, 1, 1], [1, 0, 0, 0]]
    assert batch.response_mask.dtype == torch.float32
    assert batch.per_token["advantages"].tolist() == [[0.5, 0.5, 0, 0], [-1, -1, -1, -1], [2, 0, 0, 0]]
    assert batch.per_sequence["reward"].tolist() == [1.0, 0.0, 0.5]
    # positions count attended tokens from 0 in every row
    assert batch.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 4, 4],
        [0, 0, 0, 1, 2, 3, 4],
        [0, 0, 1, 2, 2, 2, 2],
    ]


def test_collate_default_mask_covers_the_response():
    b = collate([[1], [2, 3]], [[4, 5, 6], [7]], pad_token_id=9)
    assert b.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.input_ids.tolist() == [[9, 1, 4, 5, 6], [2, 3, 7, 9, 9]]
    assert b.per_token == {} and b.per_sequence == {}


def test_collate_empty_responses_keep_one_column():
    b = collate([[1, 2], [3]], [[], []], pad_token_id=0)
    assert b.response_width == 1
    assert b.response_mask.sum() == 0
    assert b.input_ids.tolist() == [[1, 2, 0], [0, 3, 0]]


def _check_layout(sub: TokenBatch):
    prompt_width = sub.input_ids.shape[1] - sub.response_width
    assert torch.equal(sub.input_ids[:, prompt_width:], sub.response_ids)
    assert sub.attention_mask.shape == sub.input_ids.shape
    for name, value in sub.per_token.items():
        assert value.shape == sub.response_ids.shape, name
    # no column is padding in every row, except a kept first response column
    used = sub.attention_mask.sum(0) > 0
    assert used[0]
    assert used[:prompt_width + 1].all() or not used[prompt_width:].any()
    assert used[-1] or not used[prompt_width:].any()


def test_select_trims_all_padding_columns(batch):
    first = batch.select(slice(0, 1))
    assert first.input_ids.tolist() == [[1, 2, 3, 11, 12]]
    assert first.response_ids.tolist() == [[11, 12]]
    assert first.response_mask.tolist() == [[1.0, 0.0]]
    assert first.per_token["advantages"].tolist() == [[0.5, 0.5]]
    assert first.per_sequence["reward"].tolist() == [1.0]

    second = batch.select(slice(1, 2))
    assert second.input_ids.tolist() == [[4, 13, 14, 15, 16]]
    assert second.response_width == 4

    third = batch.select(torch.tensor([2]))
    assert third.input_ids.tolist() == [[5, 6, 17]]
    assert third.attention_mask.tolist() == [[1, 1, 1]]

    pair = batch.select(torch.tensor([0, 2]))
    assert pair.input_ids.tolist() == [[1, 2, 3, 11, 12], [PAD, 5, 6, 17, PAD]]
    assert pair.response_mask.tolist() == [[1, 0], [1, 0]]
    assert pair.per_sequence["reward"].tolist() == [1.0, 0.5]
    for sub in (first, second, third, pair):
        _check_layout(sub)
        torch.testing.assert_close(sub.position_ids[sub.attention_mask.bool()].max(),
                                   sub.attention_mask.sum(-1).max() - 1)


def test_select_keeps_a_response_column_when_all_responses_are_empty():
    b = collate([[1, 2], [3, 4, 5]], [[], [6]], pad_token_id=0)
    sub = b.select(slice(0, 1))
    assert sub.response_width == 1
    assert sub.input_ids.tolist() == [[1, 2, 0]]
    _check_layout(sub)


def test_micro_batches_cover_every_row():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 7, (7, 2), generator=gen).tolist()
    prompts = [[100 + i] * p for i, (p, _) in enumerate(lengths)]
    responses = [[200 + i] * r for i, (_, r) in enumerate(lengths)]
    full = collate(prompts, responses, pad_token_id=0,
                   per_token={"adv": [[float(i)] * r for i, (_, r) in enumerate(lengths)]},
                   per_sequence={"idx": [float(i) for i in range(7)]})
    micro = full.micro_batches(3)
    assert [m.size for m in micro] == [3, 3, 1]
    assert torch.cat([m.per_sequence["idx"] for m in micro]).tolist() == list(range(7))
    assert sum(float(m.response_mask.sum()) for m in micro) == float(full.response_mask.sum())
    assert sum(float((m.per_token["adv"] * m.response_mask).sum()) for m in micro) == pytest.approx(
        float((full.per_token["adv"] * full.response_mask).sum()))
    row = 0
    for m in micro:
        _check_layout(m)
        for i in range(m.size):
            assert m.response_ids[i][m.response_mask[i].bool()].tolist() == responses[row]
            attended = m.input_ids[i][m.attention_mask[i].bool()].tolist()
            assert attended == prompts[row] + responses[row]
            row += 1
    assert row == 7
    assert len(full.micro_batches(100)) == 1


# -------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_warmup(schedule):
    # warmup 4: (step + 1) / 4 = .25, .5, .75, 1.0; then the schedule starts at 1.0
    assert [lr_multiplier(s, 4, 10, schedule) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(4, 4, 10, schedule) == 1.0


def test_constant():
    assert [lr_multiplier(s, 0, 10, "constant") for s in (0, 5, 9, 50)] == [1.0] * 4


def test_cosine():
    # warmup 2, total 10 -> progress = (step - 2) / 8
    # step 2: 1.0 ; step 4: .5 (1 + cos(pi/4)) = .853553 ; step 6: .5 ; step 10: 0 ; step 30: clamped 0
    assert lr_multiplier(2, 2, 10, "cosine") == pytest.approx(1.0)
    assert lr_multiplier(4, 2, 10, "cosine") == pytest.approx(0.853553, abs=1e-6)
    assert lr_multiplier(6, 2, 10, "cosine") == pytest.approx(0.5)
    assert lr_multiplier(10, 2, 10, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_multiplier(30, 2, 10, "cosine") == pytest.approx(0.0, abs=1e-12)
    # no warmup, total 4: step 1 -> .5 (1 + cos(pi/4))
    assert lr_multiplier(1, 0, 4, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_linear():
    # warmup 2, total 10: step 4 -> 1 - 2/8 = .75 ; step 6 -> .5 ; step 9 -> .125 ; step 10 -> 0
    assert lr_multiplier(4, 2, 10, "linear") == pytest.approx(0.75)
    assert lr_multiplier(6, 2, 10, "linear") == pytest.approx(0.5)
    assert lr_multiplier(9, 2, 10, "linear") == pytest.approx(0.125)
    assert lr_multiplier(10, 2, 10, "linear") == pytest.approx(0.0)
    assert lr_multiplier(11, 2, 10, "linear") == pytest.approx(0.0)


def test_schedules_are_monotone_after_warmup():
    for schedule in ("cosine", "linear"):
        values = [lr_multiplier(s, 3, 20, schedule) for s in range(3, 21)]
        assert all(a >= b for a, b in itertools.pairwise(values))
        assert all(0.0 <= v <= 1.0 for v in values)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="step_decay"):
        lr_multiplier(5, 0, 10, "step_decay")
