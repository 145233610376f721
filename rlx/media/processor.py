"""rlx's own media processor: a prompt row's media -> the model's inputs, placeholders expanded.

A dataset prompt holds one placeholder token per media item (`<image>`); the model wants as many
placeholder tokens as the item has features, and the item's pixels in its own layout. The
processor does both, once per prompt group (the rollout hands the result to all of the group's
samples). It is built from the model's config, never from `AutoProcessor` (whose image and video
processors need torchvision), so what it produces is checked against the architecture itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from rlx.errors import DataError
from rlx.media.inputs import MediaInputs

if TYPE_CHECKING:
    from rlx.config import MediaLimits
    from rlx.data.rows import PromptRow

# CLIP's normalisation (OpenAI's statistics), which LLaVA's CLIP towers are trained with
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class MediaProcessor(Protocol):
    def __call__(self, prompt_ids: list[int], row: PromptRow) -> tuple[list[int], MediaInputs]:
        """The prompt's token ids with each placeholder expanded, and its media as model inputs."""


def expand_placeholders(token_ids: Sequence[int], placeholder_id: int, counts: Sequence[int]) -> list[int]:
    """Replace the i-th `placeholder_id` by `counts[i]` copies of it; the numbers must agree."""
    found = sum(token == placeholder_id for token in token_ids)
    if found != len(counts):
        raise ValueError(f"{found} placeholder token(s) {placeholder_id} in the prompt for {len(counts)} media item(s)")
    out: list[int] = []
    items = iter(counts)
    for token in token_ids:
        out.extend([token] * next(items) if token == placeholder_id else [token])
    return out


class LlavaImageProcessor:
    """Images for a LLaVA model: resized to its CLIP tower's square input (bicubic), scaled to
    [0, 1], normalised with CLIP's statistics; one placeholder becomes one token per patch feature
    (plus the class token's when the model keeps it: `vision_feature_select_strategy=full`)."""

    def __init__(self, config: Any, limits: MediaLimits) -> None:
        vision = config.vision_config
        self.size, self.limits = vision.image_size, limits
        self.image_token_id = config.image_token_id
        self.tokens_per_image = (vision.image_size // vision.patch_size) ** 2 + (
            config.vision_feature_select_strategy == "full")

    def pixels(self, image: np.ndarray) -> torch.Tensor:
        """[3, size, size] float32 from an RGB uint8 [H, W, 3] image."""
        from PIL import Image

        resized = np.asarray(Image.fromarray(image).resize((self.size, self.size), Image.Resampling.BICUBIC))
        scaled = resized.astype(np.float32) / 255.0
        normalised = (scaled - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)
        return torch.from_numpy(normalised.transpose(2, 0, 1).copy())

    def __call__(self, prompt_ids: list[int], row: PromptRow) -> tuple[list[int], MediaInputs]:
        from rlx.media.loading import load_image

        unsupported = sorted(kind for kind, items in row.media.items() if items and kind != "image")
        if unsupported:
            raise DataError(f"{row.source}: this model (LLaVA) reads images only; the row carries {unsupported}: "
                            "drop those data.media_keys or use a model that takes them")
        images = [load_image(item, self.limits, row.source) for item in row.media.get("image", ())]
        try:
            ids = expand_placeholders(prompt_ids, self.image_token_id, [self.tokens_per_image] * len(images))
        except ValueError as exc:
            raise DataError(f"{row.source}: {exc}: each <image> in the prompt must stay one token after the chat "
                            "template (check the tokenizer has <image> as a special token)") from None
        if not images:
            return ids, {}
        return ids, {"pixel_values": torch.stack([self.pixels(image) for image in images])}


def processor_for(config: Any, limits: MediaLimits) -> MediaProcessor:
    """The processor for a model's config (`transformers` config object); a clear error for a
    model rlx cannot feed media to."""
    if config.model_type == "llava":
        return LlavaImageProcessor(config, limits)
    raise ValueError(f"model type {config.model_type!r} takes no media in rlx (data.media_keys is set): "
                     "supported are LLaVA models (e.g. the built-in smollm2-135m-vision)")
