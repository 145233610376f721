"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, the Qwen2.5-Omni and Qwen3-Omni thinkers), computed
one way for the engine and the trainer.

These models rotate each token by three positions (time, height, width): text tokens take the same
value in all three, an image's tokens span its grid, so after an image the positions run behind the
token count by a per-row `delta`. Left to itself the model computes them only when `position_ids` is
None and then keeps one `rope_deltas` on the module for the whole batch, which breaks when rows join
and leave a running batch. rlx passes them explicitly instead: the model's own `get_rope_index` over
the real (attended) tokens of each row, so padding never shifts them, and a per-row delta that the
engine adds to a row's 1-D position at every decode step.

The Qwen-Omni thinkers find their media by the marker tokens and continue text positions through
audio (only images and videos span a grid); their `get_rope_index` takes the grids, the audio clips'
real frame counts and each video's seconds per temporal patch instead of token types. Qwen3-Omni's
positions are floats (a video's time axis can fall between integers); they stay floats.

Every other model keeps 1-D positions (`cumsum(attention_mask) - 1`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlx.media.inputs import MediaInputs

if TYPE_CHECKING:  # transformers costs seconds to import
    from transformers import PreTrainedModel

OMNI_MODEL_TYPES = frozenset({"qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"})
MROPE_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}) | OMNI_MODEL_TYPES
# media inputs get_rope_index reads: grids; Qwen2.5-VL's (and Omni's) seconds per temporal patch of each
# video; Omni's audio masks, whose sums are the clips' real frames
VL_POSITION_INPUTS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
POSITION_INPUTS = (*VL_POSITION_INPUTS, "video_second_per_grid", "feature_attention_mask")


def uses_mrope(model: PreTrainedModel) -> bool:
    """True for the models whose positions `mrope_positions` computes."""
    return getattr(getattr(model, "config", None), "model_type", None) in MROPE_MODEL_TYPES


def linear_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """1-D positions: each attended token's index among its row's attended tokens (padding: 0)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def mm_token_type_ids(input_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """Per token 0 (text), 1 (image placeholder) or 2 (video placeholder), as get_rope_index takes them."""
    return (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()


def mrope_positions(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    media: MediaInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """([3, B, L] positions, [B] deltas) for a batch whose rows' media inputs are `media` (row order).

    A row's delta is the position a text token right after its last column would take, minus the
    number of tokens the row attends: the engine's next 1-D position plus the delta continues the row
    exactly as the trainer, which scores prompt and response together, positions it. (This is the
    model's own `rope_deltas` except after a video whose time axis outruns its height and width:
    there the model's decode jumps past the video's largest position, its training forward does not.)
    Padding columns get the model's filler position (0; 1 for Qwen2.5-Omni): nothing attends them."""
    batch = input_ids.shape[0]
    if not any(key in media for key in POSITION_INPUTS):  # text only: M-RoPE's three axes are the 1-D positions
        return linear_positions(attention_mask).expand(3, -1, -1), input_ids.new_zeros(batch)
    # one text column appended, attended in every row: where each row would go on (token 0 is no marker)
    mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], 1)
    ids = torch.cat([input_ids, input_ids.new_zeros((batch, 1))], 1)
    positions = _rope_index(model, ids, mask, media)
    return positions[:, :, :-1], positions[0, :, -1] - attention_mask.sum(-1)


def _rope_index(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                media: MediaInputs) -> torch.Tensor:
    """[3, B, L] positions from the model's own `get_rope_index`, given what its family reads."""
    if model.config.model_type in OMNI_MODEL_TYPES:
        masks = media.get("feature_attention_mask")
        positions, _ = model.get_rope_index(
            input_ids, media.get("image_grid_thw"), media.get("video_grid_thw"), attention_mask,
            use_audio_in_video=False, audio_seqlens=None if masks is None else masks.sum(-1),
            second_per_grids=media.get("video_second_per_grid"))
        return positions
    types = mm_token_type_ids(input_ids, model.config)
    grids = {key: media[key] for key in VL_POSITION_INPUTS if key in media}
    positions, _ = model.base_model.get_rope_index(input_ids, mm_token_type_ids=types, attention_mask=attention_mask,
                                                   **grids)
    return positions


def position_ids(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 media: MediaInputs) -> torch.Tensor:
    """The positions a forward over whole sequences passes: [3, B, L] for M-RoPE models, else [B, L]."""
    if uses_mrope(model):
        return mrope_positions(model, input_ids, attention_mask, media)[0]
    return linear_positions(attention_mask)
