"""Checks every multimodal family shares: the engine against the trainer through refills, and over two
turns of one trajectory with new media in the second."""

from __future__ import annotations

import torch

from rlx.engines.generation import hf
from rlx.engines.generation.base import GenerationRequest, GenerationResult, SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.engines.training import collate, token_logprobs
from rlx.media.inputs import MediaInputs, concat_media


def beside_a_longer_text_row(ids: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([2, L + 5] ids, mask): the [1, L] row `ids` left-padded by 5 beside a text-only row of L + 5."""
    width = ids.shape[1] + 5
    padded = torch.full((2, width), pad_id)
    padded[0, 5:], padded[1] = ids[0], torch.arange(width) % 20 + 3
    mask = torch.ones_like(padded)
    mask[0, :5] = 0
    return padded, mask


def generate_through_refills(model, requests: list[GenerationRequest], pad_id: int, eos_id: int,
                             monkeypatch) -> list[GenerationResult]:
    """The requests through 4 batch slots, with many stop tokens: rows finish at different steps, so
    slots free up one by one and refills merge into the running cache (asserted)."""
    merges = []
    merge = hf._Running.merge
    monkeypatch.setattr(hf._Running, "merge", lambda self, other: (merges.append(len(other.rows)), merge(self, other)))
    engine = HFGenerationEngine(model, pad_id, (eos_id,), max_batch_size=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=1, stop_token_ids=tuple(range(30, 50)))
    results = engine.generate(requests, params)
    assert merges, "no refill merged into a running cache: the test lost its point"
    assert len({len(r.response_ids) for r in results}) > 1
    return results


def refill_gaps(model, requests: list[GenerationRequest], pad_id: int, eos_id: int,
                monkeypatch) -> tuple[list[GenerationResult], dict[int | None, float]]:
    """The requests generated through refills, and the largest gap between the engine's log-probs and
    the trainer's, scoring them as one batch (None) and in micro-batches of 3 (which trim columns, so
    positions are recomputed per sub-batch)."""
    results = generate_through_refills(model, requests, pad_id, eos_id, monkeypatch)
    gaps = {}
    for micro_batch in (None, 3):
        trained = trainer_logprobs(model, requests, results, pad_id, micro_batch=micro_batch)
        gaps[micro_batch] = max((t - torch.tensor(r.logprobs)).abs().max().item() for t, r in zip(trained, results))
    return results, gaps


def trainer_logprobs(model, requests: list[GenerationRequest], results: list[GenerationResult], pad_id: int,
                     temperature: float = 1.0, micro_batch: int | None = None) -> list[torch.Tensor]:
    """The trainer's log-probs of each result's response, its media from its request."""
    media = {r.request_id: r.media for r in requests}
    batch = collate([r.prompt_ids for r in results], [r.response_ids for r in results], pad_id,
                    media=[media[r.request_id] for r in results])
    parts = batch.micro_batches(micro_batch) if micro_batch else [batch]
    with torch.no_grad():
        scored = [row for part in parts for row in token_logprobs(model, part, temperature)[0]]
    return [row[:len(r.logprobs)] for row, r in zip(scored, results)]


def second_turn_gap(model, pad_id: int, eos_id: int, first: tuple[list[int], MediaInputs],
                    observation: tuple[list[int], MediaInputs]) -> float:
    """Turn 1 generates from the processed prompt `first`; the processed `observation` (with its own
    media) follows the response and turn 2 generates from there. The trainer scores the whole
    trajectory (both responses, the observation masked) with both turns' media in order, as one
    sequence: the largest gap between its log-probs and the engine's."""
    (first_ids, first_media), (observed_ids, observed_media) = first, observation
    engine = HFGenerationEngine(model, pad_id, (eos_id,))
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    (turn_1,) = engine.generate([GenerationRequest(0, first_ids, first_media)], params)
    both = concat_media([first_media, observed_media])
    context = turn_1.prompt_ids + turn_1.response_ids + observed_ids
    (turn_2,) = engine.generate([GenerationRequest(1, context, both)], params)
    trajectory = turn_1.response_ids + observed_ids + turn_2.response_ids
    mask = [1.0] * len(turn_1.response_ids) + [0.0] * len(observed_ids) + [1.0] * len(turn_2.response_ids)
    batch = collate([first_ids], [trajectory], pad_id, loss_masks=[mask], media=[both])
    with torch.no_grad():
        scored = token_logprobs(model, batch)[0][0]
    start = len(turn_1.response_ids) + len(observed_ids)
    engine_side = torch.tensor(turn_1.logprobs + turn_2.logprobs)
    trainer_side = torch.cat([scored[:len(turn_1.response_ids)], scored[start:start + len(turn_2.response_ids)]])
    return (trainer_side - engine_side).abs().max().item()
