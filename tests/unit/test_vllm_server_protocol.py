"""The `vllm` URL adapter's wire format, worked by hand: request bodies and reply checks."""

from __future__ import annotations

import pytest

from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.vllm_server import VLLMServerError, result_from_reply, sampling_params_body

REQUEST = GenerationRequest(request_id=4, prompt_ids=[5, 6, 7])


def reply(tokens, logprobs, finish="stop", versions=None):
    choice = {"index": 0, "finish_reason": finish, "token_ids": tokens,
              "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, logprobs)]}}
    if versions is not None:
        choice["weight_versions"] = versions
    return {"request_id": "x", "choices": [choice]}


def test_sampling_params_ask_for_the_sampled_logprob_and_a_seed_per_request():
    body = sampling_params_body(SamplingParams(temperature=0.7, max_new_tokens=9, stop_token_ids=(2,), seed=10), 4)
    assert body == {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "max_tokens": 9, "stop_token_ids": [2],
                    "stop": [], "seed": 14, "logprobs": 0, "detokenize": False}
    assert sampling_params_body(SamplingParams(stop=("\n",)), 0)["detokenize"] is True  # stop strings need text
    assert sampling_params_body(SamplingParams(), 3)["seed"] is None


def test_a_reply_becomes_a_result_with_the_version_it_was_sent_under_and_the_last_that_sampled():
    spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
    result = result_from_reply(REQUEST, reply([11, 2], [-0.5, -1e-9], versions=spans), weight_version=3, vocab=64)
    assert (result.response_ids, result.logprobs, result.finish_reason) == ([11, 2], [-0.5, -1e-9], "stop")
    assert result.weight_version == 3 and result.extra == {"last_weight_version": 4}
    assert result_from_reply(REQUEST, reply([1], [-1.0], "length"), 7).extra == {"last_weight_version": 7}


@pytest.mark.parametrize("bad, message", [
    ({"choices": []}, "not one choice"),
    (reply([11], [-0.5], finish=None), "finish_reason None"),
    (reply([11, 12], [-0.5]), "not lists of one length"),
    (reply([11], [0.5]), "log-prob 0.5 of token 11 is not a finite number <= 0"),
    (reply([99], [-0.5]), "token id 99 is outside the vocabulary [0, 64)"),
    ({"choices": [{"finish_reason": "stop", "token_ids": [11],
                   "logprobs": {"content": [{"token_id": 12, "logprob": -0.1}]}}]}, "given for sampled token 11"),
    (reply([11], [-0.5], finish="abort"), "request 4 was aborted"),
])
def test_a_malformed_or_aborted_reply_is_an_error_naming_the_route(bad, message):
    with pytest.raises(VLLMServerError, match="vLLM /inference/v1/generate failed") as caught:
        result_from_reply(REQUEST, bad, weight_version=0, vocab=64)
    assert message in str(caught.value)
