"""Images and videos into Qwen-VL model inputs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), without AutoProcessor.

The output matches transformers' Qwen2-VL image processor (PIL backend): PIL bicubic resize to a size
`smart_resize` picks, rescale by 1/255, normalise, then patches in the order the vision tower unfolds
them (merge windows first, then channel, time, patch rows, patch columns). Each image or video then
stands for t*h*w // merge_size**2 placeholder tokens in the prompt; `expand_media` writes them, inside
the vision start/end markers the family's chat template puts around each item.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from PIL import Image

from rlx.media.inputs import CLIP_MEAN, CLIP_STD, replace_placeholders

HALF = (0.5, 0.5, 0.5)

# Processor defaults per family. Qwen2-VL and Qwen2.5-VL share transformers' Qwen2VLImageProcessor and
# Qwen2VLVideoProcessor class defaults. transformers has no Qwen3-VL image processor (it maps the family
# to Qwen2VLImageProcessor and relies on the released preprocessor_config.json), so its image bounds are
# the released ones; its video bounds are Qwen3VLVideoProcessor's class defaults.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                 "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280,
                 "video_min_pixels": 128 * 28 * 28, "video_max_pixels": 28 * 28 * 768},
    "qwen2_5_vl": {"image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                   "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280,
                   "video_min_pixels": 128 * 28 * 28, "video_max_pixels": 28 * 28 * 768},
    "qwen3_vl": {"image_mean": HALF, "image_std": HALF,
                 "min_pixels": 65536, "max_pixels": 16777216,
                 "video_min_pixels": 128 * 32 * 32, "video_max_pixels": 32 * 32 * 768},
    # Qwen3-Omni: transformers' Qwen3-Omni processor uses Qwen2-VL's image and video processors (each
    # frame bounded alone, one block per video) with these video bounds; its image bounds and
    # normalisation come from the released preprocessor_config.json, taken here as Qwen3-VL's
    "qwen3_omni": {"image_mean": HALF, "image_std": HALF,
                   "min_pixels": 65536, "max_pixels": 16777216,
                   "video_min_pixels": 128 * 32 * 32, "video_max_pixels": 768 * 32 * 32},
}
# the Qwen2.5-Omni thinker's vision tower and image/video processors are Qwen2.5-VL's
MODEL_TYPE_FAMILY = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl",
                     "qwen3_vl_moe": "qwen3_vl", "qwen2_5_omni_thinker": "qwen2_5_vl",
                     "qwen3_omni_moe_thinker": "qwen3_omni"}
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class QwenVisionSpec:
    """What the processor needs to know about one Qwen-VL checkpoint: patch geometry, normalisation,
    pixel bounds (images, and each video as a whole for Qwen3-VL or per frame before it) and token ids."""

    family: str
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int
    max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_model_config(cls, config: Any, **overrides: Any) -> QwenVisionSpec:
        """Read geometry and token ids from a transformers Qwen-VL config; the rest are the family's
        processor defaults. `overrides` replace any field (min_pixels=..., max_pixels=...)."""
        model_type = getattr(config, "model_type", None)
        family = MODEL_TYPE_FAMILY.get(model_type)
        if family is None:
            raise ValueError(f"config.model_type={model_type!r} is not a Qwen-VL family; "
                             f"supported: {', '.join(MODEL_TYPE_FAMILY)}")
        vision = config.vision_config
        spec = cls(
            family=family,
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
            image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            vision_start_token_id=getattr(config, "vision_start_token_id", None),
            vision_end_token_id=getattr(config, "vision_end_token_id", None),
            **FAMILY_DEFAULTS[family],
        )
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown QwenVisionSpec field(s) {sorted(unknown)}; "
                             f"fields are {sorted(cls.__dataclass_fields__)}")
        return replace(spec, **overrides)


def _check_aspect(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image {height}x{width}: aspect ratio over {MAX_ASPECT_RATIO} is refused by Qwen-VL; "
                         "crop or pad it first")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: both multiples of `factor`, area within
    [min_pixels, max_pixels] where possible, aspect ratio kept as closely as the grid allows."""
    _check_aspect(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(num_frames: int, height: int, width: int, factor: int, temporal_factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's frame size for a video: the pixel bounds hold for all frames together, so longer
    videos get smaller frames. Sides shorter than `factor` are first scaled up to it."""
    if num_frames < temporal_factor:
        raise ValueError(f"a Qwen3-VL video needs at least temporal_patch_size={temporal_factor} frames, "
                         f"got {num_frames}; repeat its last frame")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _checked_rgb(image: np.ndarray, where: str) -> np.ndarray:
    is_rgb = (isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3
              and image.shape[2] == 3 and 0 not in image.shape)
    if not is_rgb:
        got = f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
        raise ValueError(f"{where}: expected a non-empty uint8 HxWx3 RGB array, got {got}; "
                         "decode and convert to RGB first")
    return image


def _normalised(frames: list[np.ndarray], size: tuple[int, int], spec: QwenVisionSpec) -> np.ndarray:
    """[F, C, H, W] float32: each frame PIL-bicubic resized to `size`, rescaled to [0, 1], normalised."""
    height, width = size
    resized = np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.BICUBIC))
                        for f in frames])
    scaled = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(spec.image_mean, dtype=np.float32)
    std = np.asarray(spec.image_std, dtype=np.float32)
    return ((scaled - mean) / std).transpose(0, 3, 1, 2)


def _patchify(frames: np.ndarray, spec: QwenVisionSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[F, C, H, W] -> ([t*h*w, C*T*P*P], (t, h, w)). Frames are padded to a multiple of the temporal
    patch by repeating the last; rows come merge window by merge window, as the vision tower merges."""
    temporal, patch, merge = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    if pad := -len(frames) % temporal:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    num_frames, channels, height, width = frames.shape
    grid = (num_frames // temporal, height // patch, width // patch)
    blocks = frames.reshape(grid[0], temporal, channels, grid[1] // merge, merge, patch,
                            grid[2] // merge, merge, patch)
    # -> (t, h/merge, w/merge, merge_h, merge_w, C, T, P_h, P_w)
    blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return blocks.reshape(math.prod(grid), channels * temporal * patch * patch), grid


def image_inputs(images: Sequence[np.ndarray], spec: QwenVisionSpec) -> dict[str, torch.Tensor]:
    """pixel_values [patches, C*T*P*P] float32 and image_grid_thw [n, 3] int64 for uint8 HxWx3 images;
    each image is one frame repeated to fill the temporal patch."""
    patches, grids = [], []
    for i, image in enumerate(images):
        image = _checked_rgb(image, f"images[{i}]")
        size = smart_resize(image.shape[0], image.shape[1], spec.factor, spec.min_pixels, spec.max_pixels)
        flat, grid = _patchify(_normalised([image], size, spec), spec)
        patches.append(flat)
        grids.append(grid)
    if not patches:
        raise ValueError("images is empty: pass at least one image, or leave image inputs out")
    return {"pixel_values": torch.from_numpy(np.concatenate(patches)),
            "image_grid_thw": torch.tensor(grids, dtype=torch.int64)}


def video_inputs(videos: Sequence[Sequence[np.ndarray]], spec: QwenVisionSpec) -> dict[str, torch.Tensor]:
    """pixel_values_videos and video_grid_thw for videos given as their (already sampled) uint8 HxWx3
    frames. Qwen3-VL bounds the pixels of the whole video, earlier families those of each frame."""
    patches, grids = [], []
    for v, video in enumerate(videos):
        frames = [_checked_rgb(f, f"videos[{v}][{i}]") for i, f in enumerate(video)]
        if not frames:
            raise ValueError(f"videos[{v}] has no frames")
        if len({f.shape for f in frames}) > 1:
            raise ValueError(f"videos[{v}]: frames differ in size {sorted({f.shape for f in frames})}; "
                             "resize them to one size first")
        height, width = frames[0].shape[:2]
        if spec.family == "qwen3_vl":
            size = smart_resize_video(len(frames), height, width, spec.factor, spec.temporal_patch_size,
                                      spec.video_min_pixels, spec.video_max_pixels)
        else:
            size = smart_resize(height, width, spec.factor, spec.video_min_pixels, spec.video_max_pixels)
        flat, grid = _patchify(_normalised(frames, size, spec), spec)
        patches.append(flat)
        grids.append(grid)
    if not patches:
        raise ValueError("videos is empty: pass at least one video, or leave video inputs out")
    return {"pixel_values_videos": torch.from_numpy(np.concatenate(patches)),
            "video_grid_thw": torch.tensor(grids, dtype=torch.int64)}


def media_token_counts(grid_thw: torch.Tensor | Sequence[Sequence[int]], merge_size: int) -> list[int]:
    """Placeholder tokens each image/video stands for: its t*h*w patches, merge_size**2 per token."""
    return [int(t) * int(h) * int(w) // merge_size**2 for t, h, w in (tuple(row) for row in grid_thw)]


def _media_blocks(spec: QwenVisionSpec, grid_thw: torch.Tensor | None, token_id: int,
                  block_per_step: bool) -> list[list[int]]:
    """Each item's tokens: start marker, one placeholder per merged patch, end marker; with
    `block_per_step` one such block per temporal step (Qwen3-VL videos)."""
    blocks = []
    for t, h, w in ([] if grid_thw is None else grid_thw.tolist()):
        steps, per_block = (t, h * w // spec.merge_size**2) if block_per_step else (1, t * h * w // spec.merge_size**2)
        blocks.append([spec.vision_start_token_id, *[token_id] * per_block, spec.vision_end_token_id] * steps)
    return blocks


def expand_media(token_ids: Sequence[int], spec: QwenVisionSpec, image_grid_thw: torch.Tensor | None = None,
                 video_grid_thw: torch.Tensor | None = None) -> list[int]:
    """The prompt with its i-th image (video) placeholder replaced by the i-th image's (video's) block as
    the family's processor writes it: `<|vision_start|>`, one placeholder per merged patch, `<|vision_end|>`.
    A Qwen3-VL video is one block per temporal step (its processor puts timestamp text between them, which
    needs the tokenizer: left out here). A placeholder the prompt already wraps in the two markers, as the
    chat templates write it, keeps that one pair."""
    start, end = spec.vision_start_token_id, spec.vision_end_token_id
    if start is None or end is None:
        raise ValueError("the model config has no vision_start_token_id / vision_end_token_id; a Qwen-VL config "
                         "names both")
    image_blocks = _media_blocks(spec, image_grid_thw, spec.image_token_id, False)
    video_blocks = _media_blocks(spec, video_grid_thw, spec.video_token_id, spec.family == "qwen3_vl")
    with_images = replace_placeholders(token_ids, spec.image_token_id, image_blocks, (start, end), "image")
    return replace_placeholders(with_images, spec.video_token_id, video_blocks, (start, end), "video")
