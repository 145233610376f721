"""The sglang adapter against a real HTTP server: rlx's `hf` engine behind SGLang's routes."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests
import torch

from rlx.engines.generation import EngineSpec, build_generation_engine
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.sglang import SGLangEngine, SGLangError, build_sglang_engine
from rlx.models import resolve_model_path
from tests.support.sglang_server import LoopbackServer

PROMPTS = ["hello", "What is 2+2?", "abc", "x", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def model_path():
    return resolve_model_path("tiny-char")


@pytest.fixture()
def server(model_path):
    with LoopbackServer(model_path) as server:
        yield server


@pytest.fixture()
def sglang(server, model_path):
    # a small chunk size sends the tiny model's weights in several /update_weights_from_tensor calls
    spec = EngineSpec(model_path, options={"url": server.url, "timeout_s": 30, "weight_chunk_mb": 0.05})
    engine, tokenizer = build_sglang_engine(spec)
    engine.tokenizer = tokenizer
    return engine


@pytest.fixture()
def hf(model_path):
    return build_generation_engine("hf", EngineSpec(model_path))[0]


def requests_for(engine, prompts=PROMPTS):
    return [GenerationRequest(i, engine.tokenizer.encode(p)) for i, p in enumerate(prompts)]


def perturbed(engine, seed):
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in engine.model.state_dict().items()}


def assert_same_generation(remote, local):
    assert [r.request_id for r in remote] == [r.request_id for r in local]
    for a, b in zip(remote, local):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_greedy_generation_matches_the_in_process_hf_engine(sglang, hf):
    batch = requests_for(sglang)
    remote = sglang.generate(batch, GREEDY)
    assert_same_generation(remote, hf.generate(batch, GREEDY))
    assert all(r.weight_version == 0 and r.extra["last_weight_version"] == 0 for r in remote)
    sampled = sglang.generate(batch, SamplingParams(temperature=1.0, top_k=5, max_new_tokens=8, seed=1))
    for result in sampled:
        assert 1 <= len(result.response_ids) == len(result.logprobs) <= 8
        assert all(lp <= 0 for lp in result.logprobs) and result.finish_reason in ("stop", "length")


def test_load_weights_over_http_changes_outputs_and_version(sglang, hf):
    batch = requests_for(sglang)
    before = sglang.generate(batch, GREEDY)
    weights = perturbed(hf, seed=1)
    sglang.load_weights(weights, version=7)
    assert sglang.weight_version == 7 and sglang.model_info()["weight_version"] == "7"
    after = sglang.generate(batch, GREEDY)
    assert any(a.response_ids != b.response_ids for a, b in zip(before, after))
    assert all(r.weight_version == 7 for r in after)
    hf.load_weights(weights, version=7)
    assert_same_generation(after, hf.generate(batch, GREEDY))


def test_requests_in_flight_survive_a_weight_update(server, sglang, hf):
    """pause (retract) -> update -> flush -> continue while the server is decoding: nothing is
    aborted, and the requests finish on the new weights."""
    batch = requests_for(sglang, PROMPTS[:3])
    results = []
    steps = server.loop.decode_steps
    worker = threading.Thread(target=lambda: results.extend(
        sglang.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=200))))
    worker.start()
    # all three decode together (a request whose HTTP call came late would start under version 3)
    while server.loop.decode_steps < steps + 5 or server.loop.peak_batch < len(batch):
        assert worker.is_alive(), "the generation finished before the update"
        time.sleep(0.001)
    sglang.load_weights(perturbed(hf, seed=2), version=3)
    worker.join(timeout=30)
    assert len(results) == 3
    assert all(r.weight_version == 0 for r in results)  # sent under version 0 ...
    assert any(r.extra["last_weight_version"] == 3 for r in results)  # ... finished under version 3


def test_weights_broadcast_from_rank_zero_over_gloo(sglang, hf):
    batch = requests_for(sglang)
    sglang.init_weights_update_group(master_address="127.0.0.1", master_port=0, backend="gloo")
    weights = perturbed(hf, seed=3)
    sglang.update_weights_from_distributed({k: v.to(torch.bfloat16) for k, v in weights.items()}, version=8)
    assert sglang.model_info()["weight_version"] == "8"
    hf.load_weights({k: v.to(torch.bfloat16).float() for k, v in weights.items()}, version=8)
    assert_same_generation(sglang.generate(batch, GREEDY), hf.generate(batch, GREEDY))
    weights = perturbed(hf, seed=4)
    sglang.load_weights(weights, version=9)  # the full pause/update/flush/continue, by broadcast now
    hf.load_weights(weights, version=9)
    after = sglang.generate(batch, GREEDY)
    assert all(r.weight_version == 9 for r in after)
    assert_same_generation(after, hf.generate(batch, GREEDY))


def test_concurrent_requests_decode_together_and_refill_streams(server, sglang):
    params = SamplingParams(temperature=0.0, max_new_tokens=64)
    first, more = requests_for(sglang, PROMPTS[:4]), requests_for(sglang, PROMPTS[:4])
    for i, request in enumerate(more):
        request.request_id = 10 + i
    handed, completions = [], []

    def refill(free_slots):
        batch, more[:] = more[:free_slots], more[free_slots:]
        handed.append(len(batch))
        return batch

    info = requests.get(server.url + "/get_server_info", timeout=5).json()["internal_states"][0]
    results = list(sglang.stream(first, params, refill=refill, between_steps=lambda: completions.append(1)))
    assert sorted(r.request_id for r in results) == [0, 1, 2, 3, 10, 11, 12, 13]
    assert handed[0] == 4 and len(completions) == 8
    after = requests.get(server.url + "/get_server_info", timeout=5).json()["internal_states"][0]
    generated = sum(len(r.response_ids) for r in results)
    assert after["peak_batch"] >= 4  # one at a time would peak at 1
    assert after["decode_steps"] - info["decode_steps"] < generated / 2  # one at a time: one step per token


def test_server_errors_surface_naming_route_status_and_body(server, sglang, hf):
    good, bad = requests_for(sglang, PROMPTS[:2]), GenerationRequest(99, [5, 10_000])
    with pytest.raises(SGLangError, match=r"SGLang http://127\.0\.0\.1:\d+/generate failed \(HTTP 400\): "
                                          r".*outside the vocabulary"):
        list(sglang.stream(good + [bad], GREEDY))
    with pytest.raises(SGLangError, match=r"/update_weights_from_tensor failed \(HTTP 400\): 'nope' is not a weight"):
        sglang.load_weights({"nope": torch.zeros(1)}, version=5)
    assert sglang.weight_version == 0 and sglang.model_info()["weight_version"] == "0"
    # the failed update still ended the pause: generation goes on
    assert_same_generation(sglang.generate(good, GREEDY), hf.generate(good, GREEDY))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    with pytest.raises(SGLangError, match=r"SGLang http://127\.0\.0\.1:\d+/get_model_info failed "
                                          r"\(no response\): ConnectionError"):
        SGLangEngine(f"http://127.0.0.1:{closed}", timeout_s=5)
