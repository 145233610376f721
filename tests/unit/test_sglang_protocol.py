"""The sglang adapter's pure parts: request bodies, reply parsing, errors, weight payloads."""

from __future__ import annotations

import base64
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from rlx.config import ConfigError
from rlx.engines.generation import EngineSpec, server_client
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.server_client import (
    api_key_from,
    dtype_name,
    is_loopback,
    tensor_chunks,
    vocab_size,
)
from rlx.engines.generation.sglang import (
    SGLangError,
    build_sglang_engine,
    generate_body,
    result_from_response,
    sampling_params_body,
    serialize_named_tensors,
)
from rlx.models import load_tokenizer
from tests.support.sglang_server import (
    deserialize_named_tensors,
    parse_dtype,
    sampling_params_from_body,
)

REQUEST = GenerationRequest(request_id=4, prompt_ids=[5, 6, 7])


def reply(entries, finish=None, version="7"):
    return {"text": "ab", "output_ids": [e[1] for e in entries],
            "meta_info": {"id": "r", "finish_reason": finish or {"type": "stop", "matched": 2},
                          "weight_version": version, "output_token_logprobs": entries}}


def test_sampling_params_use_sglang_names_and_conventions():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5, stop=("##",),
                            stop_token_ids=(7,), seed=3)
    assert sampling_params_body(params, request_id=4) == {
        "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 5, "stop": ["##"],
        "stop_token_ids": [7], "sampling_seed": 7,
    }
    greedy = sampling_params_body(SamplingParams(temperature=0.0, top_k=5), request_id=0)
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 5 and "sampling_seed" not in greedy


def test_generate_body_asks_for_output_logprobs_only():
    body = generate_body(REQUEST, SamplingParams(max_new_tokens=3))
    assert body["input_ids"] == [5, 6, 7]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    assert body["sampling_params"]["max_new_tokens"] == 3


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.0, max_new_tokens=9),
    SamplingParams(temperature=0.5, top_p=0.8, top_k=12, stop=("x", "yz"), stop_token_ids=(3, 4)),
])
def test_the_loopback_server_reads_back_what_the_adapter_writes(params):
    assert sampling_params_from_body(sampling_params_body(params, request_id=0)) == params


@pytest.mark.parametrize("body, message", [
    ({"top_k": 0}, "top_k must be -1"),
    ({"top_p": 0.0}, "top_p must be in"),
    ({"temperature": -1.0}, "non-negative"),
    ({"ignore_eos": True}, "['ignore_eos'] are not supported"),
])
def test_the_loopback_server_refuses_what_it_cannot_honour(body, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        sampling_params_from_body(body)


def test_a_reply_pairs_token_ids_with_their_logprobs():
    result = result_from_response(REQUEST, reply([[-0.5, 11, "a"], [-0.25, 2, None]]), weight_version=6)
    assert result.response_ids == [11, 2] and result.logprobs == [-0.5, -0.25]
    assert result.prompt_ids == [5, 6, 7] and result.request_id == 4 and result.finish_reason == "stop"
    assert result.weight_version == 6 and result.extra == {"last_weight_version": 7}
    length = result_from_response(REQUEST, reply([[-1, 9, None]], {"type": "length", "length": 1}, "default"), 3)
    assert length.finish_reason == "length" and length.logprobs == [-1.0]
    assert length.extra == {"last_weight_version": 3}  # SGLang's "default" version: the one sent under


@pytest.mark.parametrize("bad, message", [
    ({"text": "x"}, "malformed reply (no meta_info)"),
    ([reply([])], "malformed reply (no meta_info)"),
    (reply([[-0.5, 11]], {"type": "weird"}), "finish_reason"),
    (reply([[-0.5, "11", None]]), "output_token_logprobs entry"),
    (reply([[None, 11, None]]), "output_token_logprobs entry"),
    ({"meta_info": {"finish_reason": {"type": "stop"}}}, "no output_token_logprobs"),
    (reply([[-0.5, 11]], {"type": "abort", "message": "Abort in waiting queue"}), "aborted: Abort in waiting queue"),
])
def test_a_malformed_or_aborted_reply_is_an_error_naming_the_route(bad, message):
    with pytest.raises(SGLangError, match="SGLang /generate failed") as caught:
        result_from_response(REQUEST, bad, weight_version=0)
    assert message in str(caught.value) and caught.value.route == "/generate"


def check_response(route: str, status: int, text: str, expect_json: bool = True) -> object:
    return server_client.check_response(route, status, text, expect_json, error=SGLangError)


def test_check_response_names_route_status_and_body():
    with pytest.raises(SGLangError, match=r"^SGLang /generate failed \(HTTP 500\): boom happened$"):
        check_response("/generate", 500, "boom\n   happened")
    with pytest.raises(SGLangError) as caught:
        check_response("/flush_cache", 400, "x" * 1000)
    assert str(caught.value).endswith("x" * 300 + "…") and caught.value.status == 400
    with pytest.raises(SGLangError, match=r"\(HTTP 502\): \(empty body\)"):
        check_response("/health", 502, "")
    with pytest.raises(SGLangError, match="reply is not JSON: <html>"):
        check_response("/get_model_info", 200, "<html>")
    with pytest.raises(SGLangError, match=r"update_weights_from_tensor failed \(HTTP 200\): shape mismatch$"):
        check_response("/update_weights_from_tensor", 200, '{"success": false, "message": "shape mismatch"}')
    with pytest.raises(SGLangError, match=r"\(HTTP 400\): no group$"):
        check_response("/update_weights_from_distributed", 400, '{"success": false, "message": "no group"}')
    with pytest.raises(SGLangError, match=r"\(HTTP 400\): top_p must be in \(0, 1\]$"):
        check_response("/generate", 400, '{"error": {"message": "top_p must be in (0, 1]"}}')
    with pytest.raises(SGLangError, match=r'\(HTTP 422\): \{"detail": \[\]\}$'):
        check_response("/generate", 422, '{"detail": []}')
    assert check_response("/flush_cache", 200, "Cache flushed.\n", expect_json=False) == "Cache flushed.\n"
    assert check_response("/get_model_info", 200, '{"weight_version": "3"}') == {"weight_version": "3"}


def test_tensor_chunks_keep_order_and_respect_the_size_limit():
    state = {f"w{i}": torch.zeros(n) for i, n in enumerate([10, 10, 30, 5, 5])}  # float32: 4 bytes each
    chunks = list(tensor_chunks(state, max_bytes=80))
    assert [[name for name, _ in chunk] for chunk in chunks] == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    assert [name for name, _ in next(tensor_chunks(state, 10**9))] == list(state)


def test_named_tensors_travel_by_value():
    base = torch.arange(1000, dtype=torch.float32)
    named = [("a", torch.randn(3, 4).to(torch.bfloat16)), ("view", base[10:14]), ("b", torch.ones(2, dtype=torch.int64))]
    payload = serialize_named_tensors(named)
    assert len(base64.b64decode(payload)) < 4000  # the 4-element view did not drag its 1000-element base along
    back = deserialize_named_tensors(payload)
    assert [name for name, _ in back] == ["a", "view", "b"]
    for (_, sent), (_, got) in zip(named, back):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def test_a_weight_payload_cannot_run_code():
    class Exploit:
        def __reduce__(self):
            return os.system, ("echo pwned",)

    payload = base64.b64encode(pickle.dumps([("w", Exploit())])).decode()
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not allowed"):
        deserialize_named_tensors(payload)


def test_dtype_names_round_trip_and_only_dtypes_parse():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        assert parse_dtype(dtype_name(dtype)) is dtype
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="'load' is not a torch dtype"):
        parse_dtype("load")


def test_building_needs_a_url_and_known_options():
    with pytest.raises(ConfigError, match="needs rollout.engine_options.url"):
        build_sglang_engine(EngineSpec(Path("unused")))
    with pytest.raises(ConfigError, match=r"unknown sglang engine_options \['urll'\]"):
        build_sglang_engine(EngineSpec(Path("unused"), options={"urll": "http://127.0.0.1:1"}))


@pytest.mark.parametrize("entry, message", [
    ([float("nan"), 11, "a"], "log-prob nan of token 11 is not a finite number <= 0"),
    ([float("inf"), 11, "a"], "log-prob inf of token 11"),
    ([float("-inf"), 11, "a"], "log-prob -inf of token 11"),
    ([0.5, 11, "a"], "log-prob 0.5 of token 11"),
    ([-0.5, 50, "a"], "token id 50 is outside the vocabulary [0, 50)"),
    ([-0.5, -1, "a"], "token id -1 is outside the vocabulary [0, 50)"),
    ([True, 11, "a"], "is not [logprob, token_id, text]"),
])
def test_a_reply_the_trainer_cannot_use_is_refused_naming_server_and_field(entry, message):
    with pytest.raises(SGLangError) as caught:
        result_from_response(REQUEST, reply([[-0.1, 3, "x"], entry]), 0, vocab_size=50, server="http://10.0.0.9:30000")
    text = str(caught.value)
    assert text.startswith("SGLang http://10.0.0.9:30000/generate failed (HTTP 200): malformed reply")
    assert message in text and "output_token_logprobs" in text
    assert caught.value.server == "http://10.0.0.9:30000"


def test_a_log_prob_a_rounding_error_above_zero_and_the_last_id_are_accepted():
    result = result_from_response(REQUEST, reply([[1e-6, 49, "x"], [-0.0, 0, "y"]]), 0, vocab_size=50)
    assert result.response_ids == [49, 0] and result.logprobs == [1e-6, 0.0]


@pytest.mark.parametrize("url, loopback", [
    ("http://127.0.0.1:30000", True), ("http://localhost:1", True), ("http://[::1]:30000", True),
    ("http://127.8.0.1", True), ("http://10.0.0.1:30000", False), ("https://sglang.example.com", False),
])
def test_loopback_urls_are_recognised(url, loopback):
    assert is_loopback(url) is loopback


def test_the_api_key_comes_from_the_named_environment_variable_or_the_option(monkeypatch):
    monkeypatch.setenv("RLX_TEST_SGLANG_KEY", "sk-123")
    assert api_key_from({"api_key_env": "RLX_TEST_SGLANG_KEY"}) == "sk-123"
    assert api_key_from({"api_key": "literal"}) == "literal"
    assert api_key_from({}) is None
    monkeypatch.delenv("RLX_TEST_SGLANG_KEY")
    with pytest.raises(ConfigError, match=r"api_key_env='RLX_TEST_SGLANG_KEY': that environment variable is unset"):
        api_key_from({"api_key_env": "RLX_TEST_SGLANG_KEY"})
    with pytest.raises(ConfigError, match="give api_key_env or api_key, not both"):
        api_key_from({"api_key_env": "X", "api_key": "y"})
    with pytest.raises(ConfigError, match="printable ASCII without spaces"):
        api_key_from({"api_key": "sk-1\r\nX-Injected: yes"})


def test_the_vocabulary_bound_is_the_larger_of_embedding_rows_and_tokenizer(tiny_path):
    tokenizer = load_tokenizer(tiny_path)
    rows = json.loads((tiny_path / "config.json").read_text())["vocab_size"]
    assert vocab_size(tiny_path, tokenizer) == max(rows, len(tokenizer))
