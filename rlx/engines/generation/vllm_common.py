"""What the in-process `vllm` engine and the client of a vLLM server (`vllm_server`) both need:
a request's sampling fields and the model's checkpoint names. Apart from both, so the client does
not import the in-process engine, which imports the client for `url`.
"""

from __future__ import annotations

from typing import Any

import torch

from rlx.engines.generation.base import SamplingParams


def meta_model(path: str) -> torch.nn.Module:
    """The folder's model without weights (meta device): what transformers needs to know how its
    in-memory weight names map back to the checkpoint's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def sampling_fields(params: SamplingParams, request_id: int) -> dict[str, Any]:
    """vLLM's `SamplingParams` fields for one request, in-process or sent to a server: the sampled
    token's log-prob only, no text unless a stop string must be matched, and a seed made distinct
    per request so a group's samples differ."""
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "stop": list(params.stop),
        "seed": None if params.seed is None else params.seed + request_id,
        "logprobs": 0,
        "detokenize": bool(params.stop),
    }
