"""Routed experts (R3) through the sglang adapter, against the loopback stand-in for SGLang.

The stand-in runs a real tiny mixture-of-experts model in rlx's `hf` engine (KV cache, left-padded
batches) and returns its routers' choices in SGLang's wire format; the adapter decodes them into
`GenerationResult.routed_experts`. They must equal the routes of one cache-free forward of prompt +
response through the same weights, and every malformed reply must fail with an error naming the field.
"""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from rlx.engines.generation import EngineSpec
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.sglang import SGLangError, build_sglang_engine
from rlx.errors import ConfigError
from rlx.models.moe import ROUTE_DTYPE, MoeRouting, stack_captured
from rlx.models.tiny import build_tiny, char_tokenizer
from tests.support.sglang_server import LoopbackServer

PROMPTS = ["hello", "What is 2+2?", "x", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
LAYERS, TOP_K, EXPERTS = 2, 2, 8  # build_tiny's MoE defaults


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", moe_family="qwen3_moe")


@pytest.fixture(scope="module")
def server(moe_path):
    with LoopbackServer(moe_path, enable_return_routed_experts=True) as server:
        yield server


@pytest.fixture()
def routed(server, moe_path):
    """An adapter asking for routed experts; any fault a test injects ends with it."""
    engine, tokenizer = build_sglang_engine(EngineSpec(moe_path, options={
        "url": server.url, "timeout_s": 30, "return_routed_experts": True}))
    yield engine, tokenizer
    server.tamper = None


def batch(tokenizer, prompts=PROMPTS) -> list[GenerationRequest]:
    return [GenerationRequest(i, tokenizer.encode(p)) for i, p in enumerate(prompts)]


def full_forward_routes(model, ids: list[int]) -> torch.Tensor:
    """Routes `[len(ids), L, K]` of one forward over `ids`: no cache, no padding, no batch."""
    with torch.no_grad(), MoeRouting.of(model).capture() as captured:
        model(input_ids=torch.tensor([ids]))
    return stack_captured(captured, 1, len(ids))[0]


def assert_routes_match_full_forward(results, model_path: Path, layers: int = LAYERS) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for result in results:
        positions = len(result.prompt_ids) + len(result.response_ids) - 1
        routes = result.routed_experts
        assert routes.dtype == ROUTE_DTYPE and tuple(routes.shape) == (positions, layers, TOP_K)
        assert int(routes.min()) >= 0 and int(routes.max()) < EXPERTS
        expected = full_forward_routes(model, result.prompt_ids + result.response_ids[:-1])
        # exact, top-k order included: fp32 KV-cached, left-padded decoding leaves no near-tie flipped here
        assert torch.equal(routes, expected)


def test_routes_equal_a_cache_free_forward_of_prompt_and_response(routed, moe_path):
    engine, tokenizer = routed
    for params in (GREEDY, SAMPLED):  # four prompts of different lengths decode together, left-padded
        results = engine.generate(batch(tokenizer), params)
        assert all(len(r.response_ids) >= 1 for r in results)
        assert_routes_match_full_forward(results, moe_path)


def test_record_routes_asks_for_them_and_without_it_none_are_requested(server, moe_path):
    recording, tokenizer = build_sglang_engine(EngineSpec(moe_path, options={"url": server.url}, record_routes=True))
    assert recording.generate(batch(tokenizer, PROMPTS[:1]), GREEDY)[0].routed_experts is not None
    plain, _ = build_sglang_engine(EngineSpec(moe_path, options={"url": server.url}))
    sent: list[dict] = []
    server.tamper = sent.append
    try:
        assert plain.generate(batch(tokenizer, PROMPTS[:1]), GREEDY)[0].routed_experts is None
    finally:
        server.tamper = None
    assert "routed_experts" not in sent[0]["meta_info"]  # not asked: the server sent none


def test_a_server_without_the_flag_is_named_in_the_error(moe_path):
    with LoopbackServer(moe_path) as plain_server:  # like SGLang without --enable-return-routed-experts
        engine, tokenizer = build_sglang_engine(EngineSpec(moe_path, options={
            "url": plain_server.url, "return_routed_experts": True}))
        with pytest.raises(SGLangError, match=r"no meta_info\.routed_experts although the request set "
                                              r"return_routed_experts: start the SGLang server with "
                                              r"--enable-return-routed-experts"):
            engine.generate(batch(tokenizer, PROMPTS[:1]), GREEDY)


def recoded(meta: dict, edit, wire: str = "int32") -> None:
    """Decode the server's int32 routes `[N, L*K]`, apply `edit`, send them back as `wire`."""
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(-1, LAYERS * TOP_K)
    meta["routed_experts"] = base64.b64encode(np.ascontiguousarray(edit(rows.copy())).astype(wire).tobytes()).decode()


def set_first(rows: np.ndarray, value: int) -> np.ndarray:
    rows[0, 0] = value
    return rows


FAULTS = {  # injected into the stand-in's reply (server.tamper), each must fail naming the field
    "not base64": (lambda meta: meta.update(routed_experts="@@ not base64 @@"),
                   r"routed_experts is not base64"),
    "not a string": (lambda meta: meta.update(routed_experts=[1, 2, 3]), r"routed_experts is not base64"),
    "a position short": (lambda meta: recoded(meta, lambda rows: rows[:-1]),
                         (r"routed_experts holds \d+ bytes, expected \d+ positions \(prompt \+ response - 1\) "
                          r"x 2 layers x top-2 int32")),
    "a layer short": (lambda meta: recoded(meta, lambda rows: rows[:, :TOP_K]), r"routed_experts holds \d+ bytes"),
    "an expert past the last": (lambda meta: recoded(meta, lambda rows: set_first(rows, EXPERTS)),
                                r"routed_experts names expert 8, outside \[0, 8\) for this model"),
    "a negative expert": (lambda meta: recoded(meta, lambda rows: set_first(rows, -7)),
                          r"routed_experts names expert -7, outside \[0, 8\)"),
    "an unknown wire dtype": (lambda meta: meta.update(routed_experts_dtype="float32"),
                              r"routed_experts_dtype 'float32' is none of"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_malformed_routed_experts_fail_naming_the_field(routed, server, fault):
    engine, tokenizer = routed
    inject, message = FAULTS[fault]
    server.tamper = lambda reply: inject(reply["meta_info"])
    with pytest.raises(SGLangError, match=r"/generate failed \(HTTP 200\): malformed reply \(meta_info\." + message):
        engine.generate(batch(tokenizer, PROMPTS[:1]), GREEDY)


def test_narrower_wire_dtypes_and_not_recorded_positions_decode(routed, server):
    """Newer SGLang may send uint8 and say so in routed_experts_dtype; -1 marks a position
    without a record (the trainer routes it itself)."""
    engine, tokenizer = routed
    request = batch(tokenizer, PROMPTS[:1])
    reference = engine.generate(request, GREEDY)[0].routed_experts

    def as_uint8(reply: dict) -> None:
        recoded(reply["meta_info"], lambda rows: rows, "u1")
        reply["meta_info"]["routed_experts_dtype"] = "uint8"

    server.tamper = as_uint8
    assert torch.equal(engine.generate(request, GREEDY)[0].routed_experts, reference)
    server.tamper = lambda reply: recoded(reply["meta_info"], lambda rows: set_first(rows, -1))
    unrecorded = engine.generate(request, GREEDY)[0].routed_experts
    assert int(unrecorded[0, 0, 0]) == -1 and torch.equal(unrecorded[1:], reference[1:])


def test_dense_layers_rows_are_dropped(tmp_path):
    """SGLang sends a row per decoder layer, zeros for dense ones; rlx keeps the MoE layers only."""
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, moe_intermediate_size=32, mlp_only_layers=[1],
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with LoopbackServer(tmp_path, enable_return_routed_experts=True) as hybrid:
        sent: list[dict] = []
        hybrid.tamper = sent.append
        engine, _ = build_sglang_engine(EngineSpec(tmp_path, options={"url": hybrid.url, "return_routed_experts": True}))
        results = engine.generate(batch(tokenizer, PROMPTS[:2]), GREEDY)
    wire = np.frombuffer(base64.b64decode(sent[0]["meta_info"]["routed_experts"]), dtype="<i4").reshape(-1, 3, TOP_K)
    assert (wire[:, 1] == 0).all()  # the dense layer's row, as SGLang leaves it
    assert_routes_match_full_forward(results, tmp_path, layers=2)


def test_routed_experts_option_is_checked(moe_path, tmp_path):
    with pytest.raises(ConfigError, match=r"return_routed_experts='yes': give true or false"):
        build_sglang_engine(EngineSpec(moe_path, options={"url": "http://127.0.0.1:9", "return_routed_experts": "yes"}))
    dense = build_tiny(tmp_path / "dense")
    with pytest.raises(ConfigError, match=r"is not a mixture-of-experts model .*: turn both off"):
        build_sglang_engine(EngineSpec(dense, options={"url": "http://127.0.0.1:9", "return_routed_experts": True}))
