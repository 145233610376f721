"""Media encoded once per prompt group: the forward inputs of a batch whose rows share media.

The n samples of a prompt group share one media-inputs object (the rollout processes a group once,
the bus stores it once). Handed to the model row by row, its encoder would run n times on the same
pixels or audio: the dominant cost of a forward when the media is large (Whisper's encoder reads a
30 s window per clip). For the families below, rlx runs the model's own media encoder (tower and
projector) once per distinct object in the batch and scatters the features into the placeholder
positions of every row that shares it, then calls the model with `inputs_embeds`: the same numbers
as the model's own forward (tested), and gradients flow into a shared feature from every row.

Qwen3-VL and the Qwen3-Omni thinker, whose deepstack features enter inside the decoder, take their
vision outputs precomputed (`mm_encoder_outputs`): rlx runs their vision tower once per distinct
object and hands the model every row's items (Qwen3-Omni's audio still goes in per row). Other
multimodal families take their media the model's own way, concatenated in row order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from rlx.media.inputs import MediaInputs, RowMedia, concat_media, media_parts

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

# one prompt's media inputs -> per kind ("image", "video") the vision tower's output for its items
VisionEncoder = Callable[["PreTrainedModel", MediaInputs], dict[str, Any]]
VISION_INPUTS = ("pixel_values", "pixel_values_videos")  # what a VisionEncoder consumes


def _deepstack_vision(tower_owner: Callable[[PreTrainedModel], Any]) -> VisionEncoder:
    """Qwen3-VL's and Qwen3-Omni's towers: features plus the deepstack features that enter inside the
    decoder, both split per item; the model takes them whole as `mm_encoder_outputs`."""
    def encode(model: PreTrainedModel, media: MediaInputs) -> dict[str, Any]:
        owner, out = tower_owner(model), {}
        if "pixel_values" in media:
            out["image"] = owner.get_image_features(media["pixel_values"], media["image_grid_thw"], return_dict=True)
        if "pixel_values_videos" in media:
            out["video"] = owner.get_video_features(media["pixel_values_videos"], media["video_grid_thw"],
                                                    return_dict=True)
        return out
    return encode


# families whose forward takes precomputed vision outputs (`mm_encoder_outputs`); their other media
# inputs (grids, audio) go to the forward as they are
VISION_ENCODERS: dict[str, VisionEncoder] = {"qwen3_vl": _deepstack_vision(lambda model: model.model),
                                             "qwen3_omni_moe_thinker": _deepstack_vision(lambda model: model)}


def forward_inputs(model: PreTrainedModel, input_ids: torch.Tensor,
                   rows: Sequence[RowMedia | None]) -> dict[str, Any]:
    """The token and media keyword arguments of a forward over `input_ids` (on the model's device)
    whose rows carry `rows` (row order; rows of one group share one object, or one first part)."""
    model_type = getattr(model.config, "model_type", "")
    rows = media_parts(rows)
    if model_type in VISION_ENCODERS and rows:
        rest = {key for row in rows for key in row} - set(VISION_INPUTS)
        return {"input_ids": input_ids, **concat_media(rows, input_ids.device, only=rest),
                "mm_encoder_outputs": vision_outputs(model, rows, VISION_ENCODERS[model_type])}
    encode = ENCODERS.get(model_type)
    if encode is None or not rows:
        return {"input_ids": input_ids, **concat_media(rows, input_ids.device)}
    return {"inputs_embeds": embed_with_media(model, input_ids, rows, encode)}


def vision_outputs(model: PreTrainedModel, rows: Sequence[RowMedia | None],
                   encode: VisionEncoder) -> dict[str, Any]:
    """Per kind, the vision tower's output for every item of the batch in row order, each distinct
    media object encoded once (rows sharing it reuse its features: gradients flow back from each)."""
    device = next(model.parameters()).device
    encoded: dict[int, dict[str, Any]] = {}
    per_kind: dict[str, list[Any]] = defaultdict(list)
    for media in media_parts(rows):
        if id(media) not in encoded:
            encoded[id(media)] = encode(model, {key: value.to(device) for key, value in media.items()})
        for kind, output in encoded[id(media)].items():
            per_kind[kind].append(output)
    joined = {}
    for kind, outputs in per_kind.items():
        layers = len(outputs[0].deepstack_features)
        joined[kind] = type(outputs[0])(
            pooler_output=tuple(item for output in outputs for item in output.pooler_output),
            deepstack_features=[tuple(item for output in outputs for item in output.deepstack_features[layer])
                                for layer in range(layers)])
    return joined


def embed_with_media(model: PreTrainedModel, input_ids: torch.Tensor, rows: Sequence[RowMedia | None],
                     encode: Encoder) -> torch.Tensor:
    """Token embeddings with each placeholder replaced by its feature, each distinct media object
    encoded once."""
    embeds = model.get_input_embeddings()(input_ids)
    encoded: dict[int, dict[int, torch.Tensor]] = {}
    parts: dict[int, list[torch.Tensor]] = defaultdict(list)
    for media in media_parts(rows):
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
