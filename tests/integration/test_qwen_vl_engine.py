"""Qwen-VL models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) through rlx's engines with M-RoPE positions.

The `hf` engine prefills with rlx's 3-D positions and decodes each row at its own delta through
continuous batching (refills merge into the cache, finished rows are compacted away); the trainer
scores the same tokens with the same positions, and the two agree. The positions are the model's
own: its forward without position_ids, and its own `generate` (which decodes with `rope_deltas`),
give what rlx gives, with and without left padding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlx.config import DataConfig, MediaLimits
from rlx.data.rows import PromptRow
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.errors import DataError
from rlx.media.loading import MediaItem
from rlx.media.positions import mm_token_type_ids, mrope_positions
from rlx.media.processor import QwenVLProcessor, processor_for
from rlx.media.video import SampledVideo
from rlx.models.tiny_vl import (
    EOS_ID,
    IMAGE_TOKEN_ID,
    PAD_ID,
    VIDEO_TOKEN_ID,
    VISION_END_ID,
    VISION_START_ID,
    VL_FAMILIES,
    tiny_vl_model,
)
from tests.integration.media_checks import beside_a_longer_text_row, refill_gaps, second_turn_gap

I, V, S, E = IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID
# (prompt ids with one placeholder per item, image sizes, video frame count): 0, 1 and 2 images, lone and
# already-wrapped placeholders, prompts of different lengths (left padding), and a video-only prompt
PROMPTS = [
    ([3, 4, I, 5, 6], [(30, 40)], 0),
    ([7, S, I, E, 8, I, 9], [(28, 28), (50, 20)], 0),
    ([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [], 0),
    ([I], [(40, 30)], 0),
    ([21, I, I, 22], [(20, 60), (33, 33)], 0),
    ([23, 24], [], 0),
    ([25, V, 26], [], 4),
]


def frames(item: MediaItem, limits: MediaLimits, where: str) -> SampledVideo:
    """The video loader the processor is given: a video item here is its frames stacked in one
    array, sampled at 2 fps."""
    return SampledVideo(list(item.array), 0.5)


def row_of(index: int, image_sizes: list[tuple[int, int]], video_frames: int) -> PromptRow:
    rng = np.random.default_rng(index)
    media = {}
    if image_sizes:
        media["image"] = tuple(MediaItem("image", array=rng.integers(0, 256, (*size, 3), dtype=np.uint8))
                               for size in image_sizes)
    if video_frames:
        media["video"] = (MediaItem("video", array=rng.integers(0, 256, (video_frames, 40, 40, 3), dtype=np.uint8)),)
    return PromptRow("", "", media=media, source=f"rows.jsonl:{index + 1}")


def requests_for(model, prompts=PROMPTS) -> list[GenerationRequest]:
    processor = QwenVLProcessor(model.config, MediaLimits(), load_video=frames)
    out = []
    for i, (ids, images, video) in enumerate(prompts):
        expanded, media = processor(ids, row_of(i, images, video))
        out.append(GenerationRequest(i, expanded, media or None))
    return out


@pytest.fixture(scope="module", params=VL_FAMILIES)
def tiny(request):
    model, _ = tiny_vl_model(request.param)
    return model


def test_engine_and_trainer_agree_through_refills(tiny, monkeypatch):
    results, gaps = refill_gaps(tiny, requests_for(tiny), PAD_ID, EOS_ID, monkeypatch)
    assert max(gaps.values()) < 1e-4, gaps
    assert all(I not in r.response_ids and V not in r.response_ids for r in results)


def captured_positions(model, ids: torch.Tensor, media: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions the model builds for itself (position_ids=None) and the logits it gives."""
    seen = {}

    def keep(module, args, kwargs) -> None:
        seen["positions"] = kwargs["position_ids"]

    hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=mm_token_type_ids(ids, model.config), **media).logits
    finally:
        hook.remove()
    return seen["positions"], logits


def test_positions_are_the_models_own_with_and_without_padding(tiny):
    # images and a video in one row, ending in text; a text-only row beside it pads it on the left
    (row,) = requests_for(tiny, [([3, I, 4, V, 5, S, I, E, 6], [(30, 40), (28, 56)], 4)])
    ids = torch.tensor([row.prompt_ids])
    own, own_logits = captured_positions(tiny, ids, row.media)
    mine, deltas = mrope_positions(tiny, ids, torch.ones_like(ids), row.media)
    assert torch.equal(mine, own)
    assert deltas.tolist() == tiny.model.rope_deltas.flatten().tolist() and deltas.item() < 0
    with torch.no_grad():
        logits = tiny(input_ids=ids, position_ids=mine, **row.media).logits
    torch.testing.assert_close(logits, own_logits, rtol=0, atol=1e-5)

    padded, mask = beside_a_longer_text_row(ids, PAD_ID)
    positions, padded_deltas = mrope_positions(tiny, padded, mask, row.media)
    assert torch.equal(positions[:, 0, 5:], mine[:, 0]) and padded_deltas.tolist() == [deltas.item(), 0]
    assert torch.equal(positions[:, 1], torch.arange(padded.shape[1]).expand(3, -1))
    text_only, zero = mrope_positions(tiny, padded, mask, {})  # no media: the 1-D positions in all three axes
    assert torch.equal(text_only[:, 1], positions[:, 1]) and zero.tolist() == [0, 0]


def test_engine_decodes_as_the_models_own_generate(tiny):
    """The model's generate decodes with its cached rope_deltas: a wrong per-row delta in the engine
    changes the logits of every generated token."""
    (row,) = requests_for(tiny, [([3, I, 4, 5, S, I, E, 6], [(30, 40), (28, 56)], 0)])
    engine = HFGenerationEngine(tiny, PAD_ID, (EOS_ID,))
    (result,) = engine.generate([row], SamplingParams(temperature=0.0, max_new_tokens=8))
    ids = torch.tensor([row.prompt_ids])
    with torch.no_grad():
        out = tiny.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                            mm_token_type_ids=mm_token_type_ids(ids, tiny.config), **row.media,
                            max_new_tokens=8, do_sample=False, suppress_tokens=[I, V], eos_token_id=EOS_ID,
                            pad_token_id=PAD_ID, output_logits=True, return_dict_in_generate=True)
    assert out.sequences[0, ids.shape[1]:].tolist() == result.response_ids
    theirs = torch.stack([step[0].log_softmax(-1)[token] for step, token in zip(out.logits, result.response_ids)])
    torch.testing.assert_close(torch.tensor(result.logprobs), theirs, rtol=0, atol=1e-4)


def test_processor_writes_the_vision_markers_once_per_item(tiny):
    assert isinstance(processor_for(tiny.config, DataConfig()), QwenVLProcessor)
    processor = QwenVLProcessor(tiny.config, MediaLimits(), load_video=frames)
    row = row_of(0, [(30, 40)], 4)
    lone, media = processor([3, I, 4, V], row)
    wrapped, _ = processor([3, S, I, E, 4, S, V, E], row)
    assert lone == wrapped
    (t, h, w) = media["video_grid_thw"][0].tolist()
    video_tokens = t * h * w // 4
    image_tokens = lone.count(I)
    assert image_tokens == media["image_grid_thw"][0].prod().item() // 4
    image_block = [S, *[I] * image_tokens, E]
    if tiny.config.model_type == "qwen3_vl":  # one block per temporal step of the video
        video_block = [S, *[V] * (video_tokens // t), E] * t
    else:
        video_block = [S, *[V] * video_tokens, E]
    assert lone == [3, *image_block, 4, *video_block]
    with pytest.raises(DataError, match=r"rows.jsonl:1: 2 image placeholder token\(s\) .* but 1 image"):
        processor([I, I, V], row)
    audio = PromptRow("", "", media={"audio": (MediaItem("audio", array=np.zeros(8)),)}, source="rows.jsonl:9")
    with pytest.raises(DataError, match=r"rows.jsonl:9: .* reads images and videos; the row carries \['audio'\]"):
        processor([3], audio)


def test_a_second_turn_with_a_new_image_agrees_with_the_trainer_over_the_whole_trajectory(tiny):
    """Turn 1 sees image A; the observation of turn 2 brings image B."""
    processor = QwenVLProcessor(tiny.config, MediaLimits(), load_video=frames)
    first = processor([3, I, 4], row_of(0, [(30, 40)], 0))
    observation = processor([5, 6, I, 7], row_of(1, [(28, 56)], 0))
    assert second_turn_gap(tiny, PAD_ID, EOS_ID, first, observation) < 1e-4


def test_image_pixel_bounds_come_from_the_config(tiny):
    big = row_of(0, [(300, 400)], 0)
    default, _ = processor_for(tiny.config, DataConfig()).__call__([I], big)
    bounded_processor = processor_for(tiny.config, DataConfig(image_pixels=(56 * 56, 4 * 28 * 28)))
    bounded, media = bounded_processor([I], big)
    factor = bounded_processor.spec.factor
    height, width = (int(v) * bounded_processor.spec.patch_size for v in media["image_grid_thw"][0, 1:])
    assert height * width <= 4 * 28 * 28 and height % factor == width % factor == 0
    assert len(bounded) < len(default)  # fewer pixels: fewer image tokens
    with pytest.raises(ValueError, match="image_pixels"):
        DataConfig(image_pixels=(100, 10))
