"""Per-token log-probs (and entropy) of response tokens, under the sampling temperature.

With `share_prompts`, rows that share a prompt run it once (`rlx.engines.training.prompt_sharing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rlx.engines.training.batch import TokenBatch
from rlx.engines.training.prompt_sharing import prompt_groups, shared_prompt_logits
from rlx.media.encode import forward_inputs
from rlx.media.inputs import concat_media
from rlx.media.positions import POSITION_INPUTS, position_ids
from rlx.models import logits_of_last
from rlx.models.moe import routing_of

if TYPE_CHECKING:  # transformers costs seconds to import; services without a model skip it
    from transformers import PreTrainedModel


def autocast_context(model: PreTrainedModel, bf16: bool):
    device_type = next(model.parameters()).device.type
    return torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def call_with_media(model: PreTrainedModel, media_inputs: Callable[[], dict[str, Any]], **kwargs: Any) -> Any:
    """`model(**kwargs, **media_inputs())`. rlx encodes media (and embeds tokens) by calling the
    model's encoders itself, once per media object; under FSDP2 that must happen inside the root
    unit's forward, whose hooks gather the encoders' parameters and, in backward, their gradients.
    So there the inputs are made by a hook that runs after FSDP's own."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return model(**kwargs, **media_inputs())

    def add_inputs(_: Any, args: tuple, known: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        # FSDP2 cast the forward's inputs to its compute dtype before this hook: these get the same
        dtype = next(model.parameters()).dtype
        made = {key: value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value
                for key, value in media_inputs().items()}
        return args, {**known, **made}

    handle = model.register_forward_pre_hook(add_inputs, with_kwargs=True)
    try:
        return model(**kwargs)
    finally:
        handle.remove()


def forward_logits(model: PreTrainedModel, batch: TokenBatch, bf16: bool, **kwargs) -> torch.Tensor:
    """The model's output logits for `batch`, on the model's device, without a KV cache.

    A batch with recorded routes is routed by them (R3); they stay in force for the backward
    pass's activation-checkpoint recomputation, until the next forward of this model. M-RoPE models
    (Qwen-VL) get the 3-D positions the generation engine gives them (rlx.media.positions)."""
    device = next(model.parameters()).device
    routing = routing_of(model)
    if routing is not None:
        routing.replay(batch.routes)
    elif batch.routes is not None:
        raise ValueError("the batch carries routed_experts but the model has no routing replay installed: "
                         "call rlx.models.moe.MoeRouting.of(model) when the model is loaded")
    input_ids, attention_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    rows_media = batch.media or []
    grids = concat_media(rows_media, device, only=POSITION_INPUTS)
    with autocast_context(model, bf16), logits_of_last(model, kwargs.get("logits_to_keep")):
        return call_with_media(
            model, lambda: forward_inputs(model, input_ids, rows_media),
            attention_mask=attention_mask,
            position_ids=position_ids(model, input_ids, attention_mask, grids),
            use_cache=False,
            **kwargs,
        ).logits


def response_logits(model: PreTrainedModel, batch: TokenBatch, bf16: bool, share_prompts: bool) -> torch.Tensor:
    """[B, R, V] logits predicting the response tokens (column r predicts `response_ids[:, r]`)."""
    groups = prompt_groups(model, batch) if share_prompts else None
    if groups is not None:
        with autocast_context(model, bf16):
            return shared_prompt_logits(model, batch, groups)
    kept = batch.response_width + 1
    return forward_logits(model, batch, bf16, logits_to_keep=kept)[:, :-1]


def token_logprobs(
    model: PreTrainedModel,
    batch: TokenBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    bf16: bool = False,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ([B, R] log-probs of `batch.response_ids`, [B, R] entropies or None).

    Greedy sampling (temperature 0) is scored at temperature 1, as the generation engine does.
    `share_prompts`: rows that share a prompt run it once (see the module docstring).
    """
    device = next(model.parameters()).device
    logits = response_logits(model, batch, bf16, share_prompts)
    logits = logits.float() / (temperature if temperature > 0 else 1.0)
    logprobs_all = torch.log_softmax(logits, dim=-1)
    targets = batch.response_ids.to(device).unsqueeze(-1)
    logprobs = logprobs_all.gather(-1, targets).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    return logprobs, entropy


def token_values(
    model: PreTrainedModel,
    batch: TokenBatch,
    with_entropy: bool = False,
    bf16: bool = False,
) -> tuple[torch.Tensor, None]:
    """[B, R] values of the states before each response token, from a one-label token classifier:
    the same columns whose logits predict the response tokens."""
    scores = forward_logits(model, batch, bf16)  # a token classifier scores every position
    return scores[:, -(batch.response_width + 1) : -1, 0].float(), None
