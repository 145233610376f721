"""rlx's Qwen-VL image/video processor against transformers' own (PIL backend), hand-worked cases,
and tiny Qwen-VL models that accept what it produces and refuse a placeholder count one short."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from rlx.media.inputs import expand_placeholders
from rlx.media.positions import mm_token_type_ids
from rlx.media.qwen_vl import (
    QwenVisionSpec,
    image_inputs,
    media_token_counts,
    smart_resize,
    smart_resize_video,
    video_inputs,
)
from rlx.models.tiny_vl import VL_FAMILIES, tiny_vl_model


def gradient(height: int, width: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x * y) % 256],
                    axis=-1).astype(np.uint8)


def checkerboard(height: int, width: int, cell: int = 7) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    dark = ((y // cell + x // cell) % 2).astype(bool)
    return np.where(dark[..., None], np.array([20, 200, 90]), np.array([250, 30, 160])).astype(np.uint8)


def noise(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def default_spec(family: str, **overrides) -> QwenVisionSpec:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    config = {"qwen2_vl": Qwen2VLConfig, "qwen2_5_vl": Qwen2_5_VLConfig, "qwen3_vl": Qwen3VLConfig}[family]()
    return QwenVisionSpec.from_model_config(config, **overrides)


# --- the spec ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("family", "patch", "mean", "pixels"), [
    ("qwen2_vl", 14, 0.48145466, (3136, 1003520)),
    ("qwen2_5_vl", 14, 0.48145466, (3136, 1003520)),
    ("qwen3_vl", 16, 0.5, (65536, 16777216)),
])
def test_spec_reads_released_geometry_and_family_defaults(family, patch, mean, pixels):
    spec = default_spec(family)
    assert (spec.family, spec.patch_size, spec.temporal_patch_size, spec.merge_size) == (family, patch, 2, 2)
    assert spec.factor == patch * 2
    assert (spec.image_token_id, spec.video_token_id, spec.vision_start_token_id) == (151655, 151656, 151652)
    assert spec.image_mean[0] == pytest.approx(mean)
    assert (spec.min_pixels, spec.max_pixels) == pixels
    assert default_spec(family, max_pixels=12345).max_pixels == 12345


def test_spec_refuses_other_models_and_unknown_fields():
    from transformers import LlamaConfig, Qwen2VLConfig

    with pytest.raises(ValueError, match="model_type='llama'"):
        QwenVisionSpec.from_model_config(LlamaConfig())
    with pytest.raises(ValueError, match="max_pixel"):
        QwenVisionSpec.from_model_config(Qwen2VLConfig(), max_pixel=1)


# --- resize -----------------------------------------------------------------------------------------------

def test_smart_resize_hand_worked_cases():
    assert smart_resize(56, 84, 28, 3136, 1003520) == (56, 84)  # already on the grid and in bounds
    assert smart_resize(37, 53, 28, 3136, 1003520) == (56, 84)  # 28x56 is under min_pixels: scaled up
    assert smart_resize(1000, 700, 28, 3136, 28 * 28 * 100) == (308, 224)  # over max_pixels: scaled down
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500, 28, 3136, 1003520)


@pytest.mark.parametrize("factor", [28, 32])
def test_smart_resize_keeps_the_grid_and_the_bounds(factor):
    low, high = 16 * factor**2, 400 * factor**2
    for height, width in [(7, 9), (37, 53), (200, 300), (999, 101), (1080, 1920), (4000, 3000)]:
        h, w = smart_resize(height, width, factor, low, high)
        assert h % factor == 0 and w % factor == 0
        assert low <= h * w <= high, (height, width, h, w)


def test_smart_resize_video_budgets_all_frames_together():
    assert smart_resize_video(8, 90, 120, 32, 2, 131072, 786432) == (128, 160)  # scaled up
    assert smart_resize_video(64, 400, 400, 32, 2, 131072, 786432) == (96, 96)  # scaled down
    with pytest.raises(ValueError, match="at least temporal_patch_size=2 frames"):
        smart_resize_video(1, 64, 64, 32, 2, 131072, 786432)


# --- images against transformers' own processor --------------------------------------------------------------

def transformers_image_processor(spec: QwenVisionSpec):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size, merge_size=spec.merge_size,
        image_mean=list(spec.image_mean), image_std=list(spec.image_std),
        min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)


@pytest.mark.parametrize("family", VL_FAMILIES)
@pytest.mark.parametrize("max_tokens", [None, 20])  # 20: the 300x200 image must shrink
def test_images_match_transformers(family, max_tokens):
    spec = default_spec(family)
    if max_tokens:
        spec = replace(spec, max_pixels=max_tokens * spec.factor**2)
    images = [gradient(37, 53), checkerboard(300, 200), noise(61, 29)]
    ours = image_inputs(images, spec)
    theirs = transformers_image_processor(spec)(images=images, input_data_format="channels_last",
                                                return_tensors="np")
    assert ours["pixel_values"].dtype == torch.float32 and ours["image_grid_thw"].dtype == torch.int64
    np.testing.assert_array_equal(ours["image_grid_thw"].numpy(), theirs["image_grid_thw"])
    np.testing.assert_allclose(ours["pixel_values"].numpy(), theirs["pixel_values"], atol=1e-5, rtol=0)
    if max_tokens:
        assert ours["image_grid_thw"][1].prod() // 4 <= max_tokens


def test_patch_order_hand_worked():
    """Rows walk each 2x2 merge window before the next; each row is (channel, time, y, x)."""
    spec = replace(default_spec("qwen2_vl"), image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0))
    image = noise(56, 84, seed=3)  # on the 28-grid already: no resampling
    out = image_inputs([image], spec)
    assert out["image_grid_thw"].tolist() == [[1, 4, 6]]
    patches = out["pixel_values"].numpy().reshape(-1, 3, 2, 14, 14)
    np.testing.assert_array_equal(patches[:, :, 0], patches[:, :, 1])  # the frame fills both time slots

    def tile(y: int, x: int) -> np.ndarray:
        return image[y * 14:(y + 1) * 14, x * 14:(x + 1) * 14].transpose(2, 0, 1) / np.float32(255)

    # window (0,0) holds patches (0,0) (0,1) (1,0) (1,1); the next window starts at patch column 2
    for row, (y, x) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]):
        np.testing.assert_allclose(patches[row, :, 0], tile(y, x), atol=1e-6)
    window_rows, window_cols = 2, 3  # the last row is the bottom-right patch
    np.testing.assert_allclose(patches[window_rows * window_cols * 4 - 1, :, 0], tile(3, 5), atol=1e-6)


def test_bad_images_are_refused_by_index():
    spec = default_spec("qwen2_vl")
    with pytest.raises(ValueError, match=r"images\[1\]: expected a non-empty uint8 HxWx3"):
        image_inputs([gradient(30, 30), gradient(30, 30).astype(np.float32)], spec)
    with pytest.raises(ValueError, match=r"images\[0\]"):
        image_inputs([gradient(30, 30)[..., 0]], spec)


# --- videos ---------------------------------------------------------------------------------------------------

def test_video_pads_frames_to_the_temporal_patch():
    spec = replace(default_spec("qwen2_vl"), video_min_pixels=3136)
    frames = [noise(56, 84, seed=s) for s in range(3)]
    out = video_inputs([frames], spec)
    assert out["video_grid_thw"].tolist() == [[2, 4, 6]]  # 3 frames -> 4 (last repeated) -> t=2
    patches = out["pixel_values_videos"].numpy().reshape(2, 24, 3, 2, 14, 14)
    np.testing.assert_array_equal(patches[1, :, :, 0], patches[1, :, :, 1])
    assert not np.array_equal(patches[0, :, :, 0], patches[0, :, :, 1])


def test_a_still_video_equals_the_image():
    spec = default_spec("qwen2_5_vl")
    spec = replace(spec, video_min_pixels=spec.min_pixels, video_max_pixels=spec.max_pixels)
    frame = checkerboard(61, 97)
    video = video_inputs([[frame, frame]], spec)
    image = image_inputs([frame], spec)
    torch.testing.assert_close(video["pixel_values_videos"], image["pixel_values"], rtol=0, atol=0)
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist()


def test_qwen3_video_size_follows_the_whole_video_budget():
    spec = default_spec("qwen3_vl")
    out = video_inputs([np.stack([gradient(90, 120)] * 8)], spec)
    assert out["video_grid_thw"].tolist() == [[4, 8, 10]]  # (128, 160) per frame, 8 frames in 4 steps
    with pytest.raises(ValueError, match="frames differ in size"):
        video_inputs([[gradient(90, 120), gradient(90, 121)]], spec)


# --- placeholders -------------------------------------------------------------------------------------------

def test_media_token_counts():
    assert media_token_counts(torch.tensor([[1, 4, 6], [2, 8, 10]]), 2) == [6, 40]
    assert media_token_counts([(1, 22, 14)], 2) == [77]


def test_expand_placeholders():
    assert expand_placeholders([5, 9, 6, 9, 7], 9, [2, 3]) == [5, 9, 9, 6, 9, 9, 9, 7]
    assert expand_placeholders([5, 6], 9, []) == [5, 6]


@pytest.mark.parametrize(("tokens", "counts", "message"), [
    ([5, 9, 6, 9], [4], r"2 media placeholder token\(s\) \(id 9\) in the prompt but 1 media item"),
    ([5, 9, 6], [4, 4], r"1 media placeholder token\(s\) \(id 9\) in the prompt but 2 media item"),
    ([5, 6], [4], r"0 media placeholder token\(s\) \(id 9\) in the prompt but 1 media item"),
    ([5, 9], [0], r"counts \[0\] are not positive"),
])
def test_expand_placeholders_refuses_mismatches(tokens, counts, message):
    with pytest.raises(ValueError, match=message):
        expand_placeholders(tokens, 9, counts)


def test_mm_token_type_ids():
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig()
    ids = [1, config.vision_start_token_id, config.image_token_id, config.image_token_id, config.video_token_id, 2]
    assert mm_token_type_ids(torch.tensor([ids]), config).tolist() == [[0, 0, 1, 1, 2, 0]]


# --- tiny models take it -----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=VL_FAMILIES)
def tiny(request):
    return tiny_vl_model(request.param)


def image_prompt(spec: QwenVisionSpec, images: list[np.ndarray]) -> tuple[list[int], dict[str, torch.Tensor]]:
    inputs = image_inputs(images, spec)
    start, end = spec.vision_start_token_id, spec.vision_end_token_id
    prompt = [3, 4]
    for _ in images:
        prompt += [start, spec.image_token_id, end, 5]
    counts = media_token_counts(inputs["image_grid_thw"], spec.merge_size)
    return expand_placeholders(prompt, spec.image_token_id, counts), inputs


def forward(model, ids: list[int], **media: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), mm_token_type_ids=mm_token_type_ids(torch.tensor([ids]), model.config),
                     **media).logits


def test_tiny_model_takes_expanded_images(tiny):
    model, spec = tiny
    assert spec.image_token_id < model.config.text_config.vocab_size
    ids, inputs = image_prompt(spec, [gradient(37, 53), checkerboard(64, 40)])
    logits = forward(model, ids, **inputs)
    assert logits.shape == (1, len(ids), model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    # 3-D positions were used: an image spans fewer positions than tokens, so the next position lags
    assert model.model.rope_deltas.item() < 0


def test_tiny_model_refuses_one_placeholder_too_few(tiny):
    model, spec = tiny
    ids, inputs = image_prompt(spec, [gradient(37, 53), checkerboard(64, 40)])
    ids.remove(spec.image_token_id)
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        forward(model, ids, **inputs)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_tiny_model_takes_an_image_and_a_video(family):
    model, spec = tiny_vl_model(family)
    spec = replace(spec, video_min_pixels=3136)
    ids, inputs = image_prompt(spec, [noise(40, 40)])
    video = video_inputs([[noise(56, 56, seed=s) for s in range(3)]], spec)
    ids = [*ids, spec.vision_start_token_id, spec.video_token_id, spec.vision_end_token_id]
    ids = expand_placeholders(ids, spec.video_token_id, media_token_counts(video["video_grid_thw"], spec.merge_size))
    assert torch.isfinite(forward(model, ids, **inputs, **video)).all()


def test_tiny_qwen3_takes_a_video_frame_by_frame():
    """Qwen3-VL positions each temporal step of a video as its own segment (between timestamp text), so
    the prompt holds one placeholder per step, each standing for h*w // merge**2 tokens."""
    model, spec = tiny_vl_model("qwen3_vl")
    video = video_inputs([[noise(64, 64, seed=s) for s in range(4)]], spec)
    t, h, w = video["video_grid_thw"][0].tolist()
    ids = [3]
    for step in range(t):
        ids += [10 + step, spec.vision_start_token_id, spec.video_token_id, spec.vision_end_token_id]
    ids = expand_placeholders(ids, spec.video_token_id, [h * w // spec.merge_size**2] * t)
    assert torch.isfinite(forward(model, ids, **video)).all()
    ids.remove(spec.video_token_id)
    with pytest.raises(ValueError, match="Video features and video tokens do not match"):
        forward(model, ids, **video)
