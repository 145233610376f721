"""Media encoded once per prompt group: the forward inputs of a batch whose rows share media.

The n samples of a prompt group share one media-inputs object (the rollout processes a group once,
the bus stores it once). Handed to the model row by row, its encoder would run n times on the same
pixels or audio: the dominant cost of a forward when the media is large (Whisper's encoder reads a
30 s window per clip). For the families below, rlx runs the model's own media encoder (tower and
projector) once per distinct object in the batch and scatters the features into the placeholder
positions of every row that shares it, then calls the model with `inputs_embeds`: the same numbers
as the model's own forward (tested), and gradients flow into a shared feature from every row.

Other multimodal families (e.g. Qwen3-VL, whose deepstack features enter inside the decoder) take
their media the model's own way, concatenated in row order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from rlx.media.inputs import MediaInputs, concat_media

if TYPE_CHECKING:  # transformers costs seconds to import
    from transformers import PreTrainedModel

# one prompt's media inputs -> per placeholder token id, its features in placeholder order
Encoder = Callable[["PreTrainedModel", MediaInputs], dict[int, torch.Tensor]]


def _llava(model: PreTrainedModel, media: MediaInputs) -> dict[int, torch.Tensor]:
    config = model.config
    features = model.model.get_image_features(
        pixel_values=media["pixel_values"], vision_feature_layer=config.vision_feature_layer,
        vision_feature_select_strategy=config.vision_feature_select_strategy, return_dict=True).pooler_output
    return {config.image_token_id: torch.cat(list(features))}


def _qwen_vl(model: PreTrainedModel, media: MediaInputs) -> dict[int, torch.Tensor]:
    config, out = model.config, {}
    if "pixel_values" in media:
        features = model.model.get_image_features(media["pixel_values"], media["image_grid_thw"]).pooler_output
        out[config.image_token_id] = torch.cat(list(features))
    if "pixel_values_videos" in media:
        features = model.model.get_video_features(media["pixel_values_videos"], media["video_grid_thw"]).pooler_output
        out[config.video_token_id] = torch.cat(list(features))
    return out


def _qwen_omni(model: PreTrainedModel, media: MediaInputs) -> dict[int, torch.Tensor]:
    config, out = model.config, {}
    if "pixel_values" in media:
        out[config.image_token_id] = torch.cat(list(
            model.get_image_features(media["pixel_values"], media["image_grid_thw"]).pooler_output))
    if "pixel_values_videos" in media:
        out[config.video_token_id] = torch.cat(list(
            model.get_video_features(media["pixel_values_videos"], media["video_grid_thw"]).pooler_output))
    if "input_features" in media:
        out[config.audio_token_id] = model.get_audio_features(
            media["input_features"], media["feature_attention_mask"]).last_hidden_state
    return out


def _audio_flamingo(model: PreTrainedModel, media: MediaInputs) -> dict[int, torch.Tensor]:
    features = model.get_audio_features(media["input_features"], media["input_features_mask"]).pooler_output
    return {model.config.audio_token_id: features}


ENCODERS: dict[str, Encoder] = {"llava": _llava, "qwen2_vl": _qwen_vl, "qwen2_5_vl": _qwen_vl,
                                "qwen2_5_omni_thinker": _qwen_omni, "audioflamingo3": _audio_flamingo}


def forward_inputs(model: PreTrainedModel, input_ids: torch.Tensor,
                   rows: Sequence[MediaInputs | None]) -> dict[str, torch.Tensor]:
    """The token and media keyword arguments of a forward over `input_ids` (on the model's device)
    whose rows carry `rows` (row order; rows of one group share one object)."""
    encode = ENCODERS.get(getattr(model.config, "model_type", ""))
    if encode is None or not any(rows):
        return {"input_ids": input_ids, **concat_media(rows, input_ids.device)}
    return {"inputs_embeds": embed_with_media(model, input_ids, rows, encode)}


def embed_with_media(model: PreTrainedModel, input_ids: torch.Tensor, rows: Sequence[MediaInputs | None],
                     encode: Encoder) -> torch.Tensor:
    """Token embeddings with each placeholder replaced by its feature, each distinct media object
    encoded once."""
    embeds = model.get_input_embeddings()(input_ids)
    encoded: dict[int, dict[int, torch.Tensor]] = {}
    parts: dict[int, list[torch.Tensor]] = defaultdict(list)
    for media in rows:
        if not media:
            continue
        if id(media) not in encoded:
            encoded[id(media)] = encode(model, {key: value.to(embeds.device) for key, value in media.items()})
        for token, features in encoded[id(media)].items():
            parts[token].append(features)
    for token, features in parts.items():
        slots = (input_ids == token).unsqueeze(-1)
        joined = torch.cat(features).to(embeds.dtype)
        if int(slots.sum()) != joined.shape[0]:
            raise ValueError(f"{int(slots.sum())} placeholder tokens {token} in the batch for {joined.shape[0]} media "
                             "features: each row's placeholders must match its media (rlx.media.processor)")
        embeds = embeds.masked_scatter(slots.expand_as(embeds), joined)
    return embeds
