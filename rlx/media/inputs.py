"""Media inputs as a model's forward takes them, for a batch of rows.

A prompt's media inputs are a dict of tensors (`pixel_values`, `image_grid_thw`, ...) whose first
dimension runs over its images (or patches); a model scatters the encoded media into the positions
of its placeholder tokens in the order they occur in the flattened batch. So a batch's inputs are
each row's, concatenated along dimension 0 in row order; rows without media add nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

MediaInputs = dict[str, torch.Tensor]
# config attributes that name a placeholder token the model replaces by media features
PLACEHOLDER_ATTRIBUTES = ("image_token_id", "video_token_id", "audio_token_id", "image_token_index")


def concat_media(rows: Sequence[MediaInputs | None], device: torch.device | str | None = None) -> MediaInputs:
    """One forward's media keyword arguments from its rows' (in row order); {} when none has media."""
    present = [row for row in rows if row]
    if not present:
        return {}
    keys = present[0].keys()
    if any(row.keys() != keys for row in present):
        raise ValueError(f"rows of one batch carry different media inputs: {sorted({k for r in present for k in r})}; "
                         "every prompt of a run must go through the same processor")
    return {key: torch.cat([row[key] for row in present]).to(device) for key in keys}


def media_token_ids(config: Any) -> tuple[int, ...]:
    """The placeholder tokens of a multimodal model's config (none for a text model): the engine
    never samples them, since the model reads them as slots for media features."""
    ids = {getattr(config, name, None) for name in PLACEHOLDER_ATTRIBUTES}
    return tuple(sorted(i for i in ids if isinstance(i, int)))
