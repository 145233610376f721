"""Qwen-Omni thinkers (Qwen2.5-Omni, Qwen3-Omni: images, videos and audio in one prompt) through rlx's engines.

rlx's processor writes each image, video and audio clip as the thinker's own processor does (a marker
pair around one placeholder per feature); the `hf` engine prefills with the media and the model's own
3-D positions and decodes through refills; the trainer scores the same tokens with the same media and
positions, each media object encoded once, and the two agree. The positions and logits equal the
model's own forward, which encodes the media itself and builds its positions from the marker tokens.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from rlx.config import DataConfig, MediaLimits
from rlx.data.rows import PromptRow
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.errors import DataError
from rlx.media.audio_features import SAMPLING_RATE, chunked_encoder_tokens, encoder_tokens, real_frames
from rlx.media.encode import forward_inputs
from rlx.media.inputs import media_token_ids
from rlx.media.loading import MediaItem
from rlx.media.positions import mrope_positions
from rlx.media.processor import QwenOmniProcessor, processor_for
from rlx.models import logits_of_last
from rlx.models.tiny_omni import (
    AUDIO_END_ID,
    AUDIO_START_ID,
    AUDIO_TOKEN_ID,
    EOS_ID,
    IMAGE_TOKEN_ID,
    OMNI_FAMILIES,
    PAD_ID,
    VIDEO_TOKEN_ID,
    VISION_END_ID,
    VISION_START_ID,
    tiny_omni_model,
)
from tests.integration.media_checks import beside_a_longer_text_row, refill_gaps, second_turn_gap
from tests.integration.test_qwen_vl_engine import frames
from tests.integration.test_qwen_vl_engine import row_of as vl_row_of

I, V, A = IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, AUDIO_TOKEN_ID
S, E, AS, AE = VISION_START_ID, VISION_END_ID, AUDIO_START_ID, AUDIO_END_ID
MARKERS = {I, V, A, S, E, AS, AE}
# (prompt ids with one placeholder per item, image sizes, video frames, audio seconds): every modality
# alone and together, lone and already-wrapped placeholders, a text-only prompt, different lengths
PROMPTS = [
    ([3, 4, I, 5, 6], [(30, 40)], 0, []),
    ([7, A, 8], [], 0, [0.7]),
    ([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [], 0, []),
    ([S, I, E, 9, AS, A, AE, 21, A], [(28, 56)], 0, [0.4, 1.3]),
    ([25, V, 26], [], 4, []),
    ([27, I, 28, V, 29, A], [(33, 33)], 4, [0.9]),
    ([23, 24], [], 0, []),
]


def clip(seconds: float, seed: int) -> np.ndarray:
    """A tone with noise: structure the log-mel and the audio tower both see."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    return (0.3 * np.sin(2 * np.pi * (220 + 110 * seed) * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def row_of(index: int, image_sizes, video_frames: int, audio_seconds) -> PromptRow:
    """Qwen-VL's test row (random images and video frames) with clips of `audio_seconds` added."""
    row = vl_row_of(index, image_sizes, video_frames)
    if not audio_seconds:
        return row
    clips = tuple(MediaItem("audio", array=clip(s, index + j)) for j, s in enumerate(audio_seconds))
    return replace(row, media={**row.media, "audio": clips})


def processor_of(model) -> QwenOmniProcessor:
    return QwenOmniProcessor(model.config, MediaLimits(), load_video=frames)


def requests_for(model, prompts=PROMPTS) -> list[GenerationRequest]:
    processor = processor_of(model)
    out = []
    for i, (ids, images, video, audio) in enumerate(prompts):
        expanded, media = processor(ids, row_of(i, images, video, audio))
        out.append(GenerationRequest(i, expanded, media or None))
    return out


@pytest.fixture(scope="module", params=OMNI_FAMILIES)
def omni(request):
    return tiny_omni_model(request.param)


def test_engine_and_trainer_agree_through_refills(omni, monkeypatch):
    results, gaps = refill_gaps(omni, requests_for(omni), PAD_ID, EOS_ID, monkeypatch)
    assert max(gaps.values()) < 1e-4, gaps
    # a sampled marker would shift the positions the model derives from them: the engine never samples one
    assert set(media_token_ids(omni.config)) == MARKERS
    assert not any(MARKERS & set(r.response_ids) for r in results)


def test_positions_and_logits_are_the_models_own_with_and_without_padding(omni):
    (row,) = requests_for(omni, [([3, I, 4, V, 5, A, 6], [(30, 40)], 4, [1.1])])
    ids = torch.tensor([row.prompt_ids])
    mine, deltas = mrope_positions(omni, ids, torch.ones_like(ids), row.media)
    own, own_deltas = omni.get_rope_index(ids, row.media["image_grid_thw"], row.media["video_grid_thw"],
                                          torch.ones_like(ids), False, row.media["feature_attention_mask"].sum(-1),
                                          row.media["video_second_per_grid"])
    assert torch.equal(mine, own) and deltas.tolist() == own_deltas.flatten().tolist() and deltas.item() < 0
    with torch.no_grad():  # the model's own forward: it encodes the media and positions the tokens itself
        theirs = omni(input_ids=ids, attention_mask=torch.ones_like(ids), **row.media).logits
        encoded_once = omni(**forward_inputs(omni, ids, [row.media]), position_ids=mine).logits
    torch.testing.assert_close(encoded_once, theirs, rtol=0, atol=1e-5)

    padded, mask = beside_a_longer_text_row(ids, PAD_ID)
    positions, padded_deltas = mrope_positions(omni, padded, mask, row.media)
    assert torch.equal(positions[:, 0, 5:], mine[:, 0]) and padded_deltas.tolist() == [deltas.item(), 0]
    assert torch.equal(positions[:, 1], torch.arange(padded.shape[1]).expand(3, -1))
    (audio_only,) = requests_for(omni, [([7, A, 8], [], 0, [0.7])])  # audio keeps text's 1-D positions
    ids = torch.tensor([audio_only.prompt_ids])
    linear, zero = mrope_positions(omni, ids, torch.ones_like(ids), audio_only.media)
    assert torch.equal(linear, torch.arange(ids.shape[1]).expand(3, 1, -1)) and zero.tolist() == [0]


def test_engine_decodes_as_the_models_own_generate(omni):
    (row,) = requests_for(omni, [([3, I, 4, A, 5], [(30, 40)], 0, [0.8])])
    engine = HFGenerationEngine(omni, PAD_ID, (EOS_ID,))
    (result,) = engine.generate([row], SamplingParams(temperature=0.0, max_new_tokens=8))
    ids = torch.tensor([row.prompt_ids])
    with torch.no_grad():
        out = omni.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **row.media, max_new_tokens=8,
                            do_sample=False, suppress_tokens=sorted(MARKERS), eos_token_id=EOS_ID,
                            pad_token_id=PAD_ID, output_logits=True, return_dict_in_generate=True)
    assert out.sequences[0, ids.shape[1]:].tolist() == result.response_ids
    theirs = torch.stack([step[0].log_softmax(-1)[token] for step, token in zip(out.logits, result.response_ids)])
    torch.testing.assert_close(torch.tensor(result.logprobs), theirs, rtol=0, atol=1e-4)


def test_processor_writes_each_item_between_its_markers(omni):
    processor = processor_for(omni.config, DataConfig())
    assert isinstance(processor, QwenOmniProcessor)
    assert processor.placeholder_ids == {"image": I, "video": V, "audio": A}
    processor = processor_of(omni)
    row = row_of(0, [(30, 40)], 4, [1.25])
    lone, media = processor([3, I, 4, V, 5, A], row)
    wrapped, _ = processor([3, S, I, E, 4, S, V, E, 5, AS, A, AE], row)
    assert lone == wrapped
    image_tokens = media["image_grid_thw"][0].prod().item() // 4
    video_tokens = media["video_grid_thw"][0].prod().item() // 4
    audio_tokens = lone.count(A)
    if omni.config.model_type == "qwen2_5_omni_thinker":
        assert audio_tokens == encoder_tokens(125) == 31  # 125 frames: 63 after the stride-2 convolution, 31 pooled
    else:
        assert audio_tokens == chunked_encoder_tokens(125, 50) == 17  # 13 for the full 1 s chunk, 4 for the rest
    assert lone == [3, S, *[I] * image_tokens, E, 4, S, *[V] * video_tokens, E, 5, AS, *[A] * audio_tokens, AE]
    # a 30 s window of Whisper features per clip, its real frames marked; the video's seconds per
    # temporal patch (2 frames at the default 2 fps) place its frames in time
    assert media["input_features"].shape == (1, 128, 3000)
    assert media["feature_attention_mask"].sum().item() == real_frames(int(1.25 * SAMPLING_RATE))
    assert media["video_second_per_grid"].tolist() == [1.0]
    slow = processor_for(omni.config, DataConfig(video={"fps": 0.5}))  # an array's frames: taken at 0.5 fps
    assert slow([3, I, 4, V, 5, A], row)[1]["video_second_per_grid"].tolist() == [4.0]

    with pytest.raises(DataError, match=r"rows.jsonl:1: 2 audio placeholder token\(s\) \(id 127\) .* but 1 audio item"):
        processor([3, I, V, A, A], row)
    too_long = row_of(4, [], 0, [30.5])
    with pytest.raises(DataError, match=r"rows.jsonl:5: audio clip 0 lasts 30.5 s, over the 30 s"):
        processor([A], too_long)
    if omni.config.model_type == "qwen2_5_omni_thinker":  # 10 ms: a token for Qwen3-Omni, none for Qwen2.5's
        too_short = row_of(5, [], 0, [0.01])
        with pytest.raises(DataError, match=r"rows.jsonl:6: audio clip 0 is too short for one audio token"):
            processor([A], too_short)


def test_a_second_turn_with_a_new_clip_and_image_agrees_with_the_trainer(omni):
    """Turn 1 hears clip A; the observation of turn 2 brings an image and clip B."""
    processor = processor_of(omni)
    first = processor([3, A, 4], row_of(0, [], 0, [0.6]))
    observation = processor([5, I, 6, A, 7], row_of(1, [(28, 56)], 0, [1.1]))
    assert second_turn_gap(omni, PAD_ID, EOS_ID, first, observation) < 1e-4


def test_audio_token_counts_are_the_encoders_own():
    """Every clip length up to the 30 s window: the count the processor writes is what the thinker's
    encoder makes (a wrong count is the "features and tokens do not match" error users hit)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    frames = torch.arange(1, QwenOmniProcessor.WINDOW_FRAMES + 1)
    qwen2_5 = tiny_omni_model("qwen2_5_omni").audio_tower._get_feat_extract_output_lengths(frames)[1]
    assert [encoder_tokens(f) for f in frames.tolist()] == qwen2_5.tolist()
    qwen3 = _get_feat_extract_output_lengths(frames, 50)
    assert [chunked_encoder_tokens(f, 50) for f in frames.tolist()] == qwen3.tolist()


def test_logits_are_built_for_the_kept_positions_only(omni):
    """The thinkers ignore `logits_to_keep`; within `logits_of_last` their output layer sees only the
    kept positions, so neither the engine's prefill nor the trainer builds [B, L, vocab] logits."""
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        every = omni(input_ids=ids, logits_to_keep=2).logits
        with logits_of_last(omni, 2):
            kept = omni(input_ids=ids, logits_to_keep=2).logits
    assert every.shape[1] == 6 and kept.shape[1] == 2
    torch.testing.assert_close(kept, every[:, -2:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", OMNI_FAMILIES)
def test_a_released_thinker_and_talker_folder_loads_its_thinker_alone(tmp_path, family):
    """A released Qwen-Omni folder is one model of thinker and talker (the composite config, the
    thinker's weights under `thinker.`). Stand-in for one (none is small enough to ship): the tiny
    thinker's folder rewritten in that layout, with a talker tensor beside it that must not load."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5OmniConfig, Qwen3OmniMoeConfig

    from rlx.models import load_model_config, load_pretrained
    from rlx.models.tiny_omni import build_tiny_omni

    thinker_path = build_tiny_omni(tmp_path / "thinker", family)
    thinker, _ = load_pretrained(thinker_path)
    released = tmp_path / "released"
    composite = {"qwen2_5_omni": Qwen2_5OmniConfig, "qwen3_omni": Qwen3OmniMoeConfig}[family]
    composite(thinker_config=thinker.config.to_dict()).save_pretrained(released)
    weights = {f"thinker.{name}": t for name, t in load_file(thinker_path / "model.safetensors").items()}
    save_file({**weights, "talker.model.norm.weight": torch.ones(8)}, released / "model.safetensors",
              metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (released / name).write_bytes((thinker_path / name).read_bytes())

    model, tokenizer = load_pretrained(released)
    assert type(model) is type(thinker) and len(tokenizer) == model.config.text_config.vocab_size
    theirs = thinker.state_dict()
    assert model.state_dict().keys() == theirs.keys()
    assert all(torch.equal(t, theirs[name]) for name, t in model.state_dict().items())
    model.save_pretrained(tmp_path / "export")  # what rlx export writes: the thinker alone, its own names
    assert load_file(tmp_path / "export" / "model.safetensors").keys() == load_file(
        thinker_path / "model.safetensors").keys()
    config = load_model_config(released)
    assert config.model_type == thinker.config.model_type
    assert processor_for(config, DataConfig()).placeholder_ids == {"image": I, "video": V, "audio": A}
