"""A multimodal model built around a pretrained text model takes over its weights exactly."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def widened(weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """A [V, H] embedding grown to `vocab` rows; new tokens (media placeholders) start at the mean."""
    extra = weight.mean(0, keepdim=True).expand(vocab - weight.shape[0], -1)
    return torch.cat([weight.detach(), extra])


def copy_text_weights(text_model: PreTrainedModel, model: PreTrainedModel, vocab: int) -> None:
    """`text_model`'s weights into `model`'s language model (`model.model.language_model`) and output
    layer: tied to the embeddings where `model`'s architecture and config tie them, else a copy of
    the text model's own (AudioFlamingo3 ties nothing)."""
    state = dict(text_model.model.state_dict())
    state["embed_tokens.weight"] = widened(state["embed_tokens.weight"], vocab)
    model.model.language_model.load_state_dict(state)
    model.tie_weights()
    head = model.get_output_embeddings().weight
    if head.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        head.data.copy_(widened(text_model.get_output_embeddings().weight, vocab))
