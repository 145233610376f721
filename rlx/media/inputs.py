"""Media inputs as a model's forward takes them, for a batch of rows, and the prompt tokens they fill.

A prompt's media inputs are a dict of tensors (`pixel_values`, `image_grid_thw`, ...) whose first
dimension runs over its images (or patches); a model scatters the encoded media into the positions
of its placeholder tokens in the order they occur in the flattened batch. So a batch's inputs are
each row's, concatenated along dimension 0 in row order; rows without an input add nothing to it
(a row with images only adds no video inputs).

A row's media may come in parts (`RowMedia`): a multi-turn trajectory's opening media, shared by
its group, then what each later observation showed. A part counts as a row of its own here, in
order, which is where its placeholders sit; each part stays one object, so a shared opening is
still encoded once (`rlx.media.encode`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are joined: an environment process never needs it
    import torch

MediaInputs = dict[str, "torch.Tensor"]
RowMedia = MediaInputs | tuple[MediaInputs | None, ...]  # one object, or parts in placeholder order
# config attributes that name a placeholder token the model replaces by media features
PLACEHOLDER_ATTRIBUTES = ("image_token_id", "video_token_id", "audio_token_id", "image_token_index")
# config attributes that name the markers around a media item (Qwen-VL, Qwen-Omni)
MARKER_ATTRIBUTES = ("vision_start_token_id", "vision_end_token_id", "audio_start_token_id", "audio_end_token_id")
# CLIP's normalisation (OpenAI's statistics): LLaVA's CLIP towers and Qwen2/2.5-VL's are trained with it
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def with_shown(opening: MediaInputs | None, shown: Sequence[MediaInputs]) -> RowMedia | None:
    """A trajectory's media: its opening's object alone, or with what its observations showed as parts."""
    return (opening, *shown) if shown else opening


def media_parts(rows: Sequence[RowMedia | None]) -> list[MediaInputs]:
    """Every media object of the rows, in row order and, within a row, part by part."""
    return [part for row in rows if row for part in (row if isinstance(row, tuple) else (row,)) if part]


def concat_media(rows: Sequence[RowMedia | None], device: torch.device | str | None = None,
                 only: Collection[str] | None = None) -> MediaInputs:
    """One forward's media keyword arguments from its rows' (in row order); {} when none has media.
    Each input joins the rows that have it: a row's images and another's video both reach the model.
    `only`: just these inputs (e.g. the grids positions are computed from)."""
    import torch

    parts = media_parts(rows)
    keys = dict.fromkeys(key for part in parts for key in part if only is None or key in only)
    return {key: torch.cat([part[key] for part in parts if key in part]).to(device) for key in keys}


def expand_placeholders(token_ids: Sequence[int], placeholder_id: int, counts: Sequence[int],
                        markers: tuple[int, int] | None = None, kind: str = "media") -> list[int]:
    """Replace the i-th single placeholder token with counts[i] copies of it: a model wants one
    placeholder per feature of the item, a dataset prompt holds one per item. With `markers`
    (start, end), each item's copies go between them."""
    if bad := [c for c in counts if c < 1]:
        raise ValueError(f"counts {bad} are not positive: each media item stands for at least one token")
    blocks = [[placeholder_id] * count for count in counts]
    if markers is not None:
        blocks = [[markers[0], *block, markers[1]] for block in blocks]
    return replace_placeholders(token_ids, placeholder_id, blocks, markers, kind)


def replace_placeholders(token_ids: Sequence[int], placeholder_id: int, blocks: Sequence[Sequence[int]],
                         markers: tuple[int, int] | None = None, kind: str = "media") -> list[int]:
    """The prompt with its i-th placeholder replaced by blocks[i]. A placeholder the prompt already
    wraps in `markers` (start, end), as chat templates write it, loses that pair: the block brings its own."""
    ids = list(token_ids)
    if (found := ids.count(placeholder_id)) != len(blocks):
        raise ValueError(f"{found} {kind} placeholder token(s) (id {placeholder_id}) in the prompt but {len(blocks)} "
                         f"{kind} item(s): put exactly one placeholder per {kind} item, in order")
    remaining = iter(blocks)
    out: list[int] = []
    skip_end = False
    for i, token in enumerate(ids):
        if skip_end:
            skip_end = False
        elif token != placeholder_id:
            out.append(token)
        else:
            if markers is not None and out[-1:] == [markers[0]] and ids[i + 1:i + 2] == [markers[1]]:
                out.pop()
                skip_end = True
            out.extend(next(remaining))
    return out


def media_token_ids(config: Any) -> tuple[int, ...]:
    """The placeholder and marker tokens of a multimodal model's config (none for a text model): the
    engine never samples them, since the model reads placeholders as slots for media features and
    Qwen-Omni counts markers to find its media items when it positions the tokens."""
    ids = {getattr(config, name, None) for name in (*PLACEHOLDER_ATTRIBUTES, *MARKER_ATTRIBUTES)}
    return tuple(sorted(i for i in ids if isinstance(i, int)))
