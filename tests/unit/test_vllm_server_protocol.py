"""The `vllm` URL adapter's wire format, worked by hand: request bodies and reply checks."""

from __future__ import annotations

import pytest
import torch

from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.vllm_common import sampling_fields
from rlx.engines.generation.vllm_server import (
    VLLMServerEngine,
    VLLMServerError,
    result_from_reply,
    warn_if_exposed,
)
from rlx.errors import ConfigError

REQUEST = GenerationRequest(request_id=4, prompt_ids=[5, 6, 7])


def reply(tokens, logprobs, finish="stop", versions=None):
    choice = {"index": 0, "finish_reason": finish, "token_ids": tokens,
              "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, logprobs)]}}
    if versions is not None:
        choice["weight_versions"] = versions
    return {"request_id": "x", "choices": [choice]}


def test_sampling_params_ask_for_the_sampled_logprob_and_a_seed_per_request():
    body = sampling_fields(SamplingParams(temperature=0.7, max_new_tokens=9, stop_token_ids=(2,), seed=10), 4)
    assert body == {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "max_tokens": 9, "stop_token_ids": [2],
                    "stop": [], "seed": 14, "logprobs": 0, "detokenize": False}
    assert sampling_fields(SamplingParams(stop=("\n",)), 0)["detokenize"] is True  # stop strings need text
    assert sampling_fields(SamplingParams(), 3)["seed"] is None


def test_a_reply_carries_the_versions_that_sampled_its_first_and_last_tokens():
    spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
    # sent under version 2, queued while version 3 loaded: its first token was sampled by 3
    result = result_from_reply(REQUEST, reply([11, 2], [-0.5, -1e-9], versions=spans), weight_version=2, vocab=64)
    assert (result.response_ids, result.logprobs, result.finish_reason) == ([11, 2], [-0.5, -1e-9], "stop")
    assert result.weight_version == 3 and result.extra == {"last_weight_version": 4}
    # no spans, or vLLM's "default" label before any load: the version it was sent under
    assert result_from_reply(REQUEST, reply([1], [-1.0], "length"), 7).weight_version == 7
    unlabelled = reply([1], [-1.0], versions=[{"version": "default", "start": 0, "end": 1}])
    assert result_from_reply(REQUEST, unlabelled, 0).extra == {"last_weight_version": 0}


@pytest.mark.parametrize("bad, message", [
    ({"choices": []}, "not one choice"),
    (reply([11], [-0.5], finish=None), "finish_reason None"),
    (reply([11, 12], [-0.5]), "not lists of one length"),
    (reply([11], [0.5]), "log-prob 0.5 of token 11 is not a finite number <= 0"),
    (reply([99], [-0.5]), "token id 99 is outside the vocabulary [0, 64)"),
    (reply([11], [-9999.0]), "vLLM's stand-in for a missing or non-finite one"),
    ({"choices": [{"finish_reason": "stop", "token_ids": [11],
                   "logprobs": {"content": [{"token_id": 12, "logprob": -0.1}]}}]}, "given for sampled token 11"),
    (reply([11], [-0.5], finish="abort"), "request 4 was aborted"),
])
def test_a_malformed_or_aborted_reply_is_an_error_naming_the_route(bad, message):
    with pytest.raises(VLLMServerError, match="vLLM /inference/v1/generate failed") as caught:
        result_from_reply(REQUEST, bad, weight_version=0, vocab=64)
    assert message in str(caught.value)


class Launched(VLLMServerEngine):
    """The adapter's launch checks against canned replies: a stand-in for servers launched wrong,
    which a test cannot start one of each of (a real server is in test_vllm_server_adapter.py)."""

    def __init__(self, replies: dict[str, object]) -> None:  # no HTTP session: `_call` answers from `replies`
        self.url, self.replies = "http://127.0.0.1:1", replies

    def _call(self, method, route, body=None, expect_json=True, params=None):
        reply = self.replies[route]
        if isinstance(reply, int):
            raise VLLMServerError(route, reply, "refused", self.url)
        return reply


def server_info(mode="processed_logprobs", backend="rlx_gloo", dtype="torch.float32"):
    return {"vllm_config": {"model_config": {"logprobs_mode": mode, "dtype": dtype},
                            "weight_transfer_config": {"backend": backend}}}


@pytest.mark.parametrize("replies, message", [
    ({"/server_info": 404}, "does not serve its RL API .*VLLM_SERVER_DEV_MODE=1"),
    ({"/server_info": server_info(mode="raw_logprobs")}, "logprobs_mode='raw_logprobs'.*--logprobs-mode"),
    ({"/server_info": server_info(backend="nccl")}, "backend 'nccl', not 'rlx_gloo'.*--weight-transfer-config"),
    ({"/server_info": server_info(dtype="torch.bfloat16")}, "runs bfloat16.*--dtype float32"),
    ({"/server_info": server_info(), "/inference/v1/generate": 403}, "/inference/v1/generate.*--enable-scale-out"),
])
def test_a_server_launched_without_what_rlx_needs_is_refused_naming_the_flag(replies, message):
    with pytest.raises(ConfigError, match=message):
        Launched(replies)._check_launch("float32")


def test_a_server_launched_as_rlx_needs_passes_and_gives_its_dtype():
    replies = {"/server_info": server_info(), "/inference/v1/generate": {"choices": []}}
    assert Launched(replies)._check_launch("float32") == torch.float32


# -- what the unauthenticated dev routes may hand rlx_gloo (N14) ---------------------------------------------
@pytest.mark.parametrize("update, message", [
    ({"names": ["w"], "dtype_names": ["Tensor"], "shapes": [[2]]}, "dtype 'Tensor' is not a weight dtype"),
    ({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, -1]]}, "is not a list of non-negative sizes"),
    ({"names": ["w"], "dtype_names": ["float32"], "shapes": [[True]]}, "is not a list of non-negative sizes"),
    ({"names": ["w"], "dtype_names": ["float32"], "shapes": ["22"]}, "is not a list of non-negative sizes"),
])
def test_an_update_with_a_foreign_dtype_or_shape_is_refused(update, message):
    transfer = pytest.importorskip("rlx.engines.generation.vllm_transfer")
    with pytest.raises(ValueError, match=message):
        transfer.GlooUpdateInfo(**update)


def test_an_update_larger_than_the_model_is_refused_before_allocating():
    transfer = pytest.importorskip("rlx.engines.generation.vllm_transfer")
    engine = object.__new__(transfer.GlooWeightTransferEngine)  # the checks need only its model and group
    engine.model, engine.group = torch.nn.Linear(4, 4), object()
    huge = transfer.GlooUpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[1 << 20, 1 << 20]])
    with pytest.raises(ValueError, match=r"announces 4398046511104 bytes, more than 2x the model's 80: refused"):
        engine.receive_weights(huge)


def test_a_group_timeout_past_the_cap_is_refused():
    transfer = pytest.importorskip("rlx.engines.generation.vllm_transfer")
    with pytest.raises(ValueError, match=r"timeout_s=1000000000.0 must be a number in \(0, 3600\]"):
        transfer.GlooInitInfo("127.0.0.1", 1234, 1, 2, timeout_s=1e9)
    assert transfer.GlooInitInfo("127.0.0.1", 1234, 1, 2).timeout_s == 600.0


def test_a_served_dtype_rlx_does_not_know_is_refused():
    with pytest.raises(VLLMServerError, match=r"/server_info failed \(HTTP 200\): reports dtype 'Tensor'"):
        Launched({"/server_info": server_info(dtype="Tensor")})._check_launch(None)


def test_a_dev_mode_server_off_loopback_is_warned_about(caplog):
    warn_if_exposed("http://127.0.0.1:8000", "127.0.0.1")
    assert not caplog.records
    warn_if_exposed("http://10.0.0.5:8000", "10.0.0.2")
    assert "not on loopback" in caplog.text and "private network" in caplog.text
