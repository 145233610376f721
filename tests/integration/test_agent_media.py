"""Environments that show media mid-trajectory: an observation's image is expanded and encoded by the
rollout's processor, goes with every later turn's request after the opening's, and reaches the
trainer as parts of the sample's media, so the trainer scores every policy turn as the engine did.
Media the environment gets wrong fail only their trajectory, with the reason."""

from __future__ import annotations

import re
import string

import numpy as np
import pytest
import torch

from rlx.agents.environments import user_environment
from rlx.agents.loop import AgentRollout, TurnLimits
from rlx.config import DataConfig
from rlx.data.rows import PromptRow
from rlx.engines.generation.base import SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.engines.training import token_logprobs
from rlx.media.loading import MediaItem
from rlx.media.processor import processor_for
from rlx.models import load_pretrained
from rlx.models.tiny_vl import IMAGE_TOKEN_ID, VISION_START_ID, build_tiny_vl
from rlx.roles.batching import samples_to_batch

ENVS = "tests.integration.agent_envs"


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def tiny(request, tmp_path_factory):
    """A tiny Qwen2-VL (features scattered into the embeddings) or Qwen3-VL (deepstack vision
    outputs handed to the model) with the tiny-char tokenizer and its chat template."""
    path = build_tiny_vl(tmp_path_factory.mktemp("models") / request.param, request.param)
    model, tokenizer = load_pretrained(path)
    return model.eval(), tokenizer


def _play(tiny, options: dict | None = None, with_processor: bool = True, opening: bool = True) -> list:
    model, tokenizer = tiny
    engine = HFGenerationEngine(model, tokenizer.pad_token_id, (tokenizer.eos_token_id,), tokenizer, 8)
    processor = processor_for(model.config, DataConfig(media_keys={"image": "images"})) if with_processor else None
    rollout = AgentRollout(engine, tokenizer, user_environment(f"{ENVS}:ShowsAnImage", options or {}),
                           TurnLimits(max_turns=3, max_trajectory_tokens=400), concurrency=4, processor=processor)
    rng = np.random.default_rng(0)
    rows = [PromptRow("<image> which digit?" if opening else "which digit?", "3", source=f"rows.jsonl:{i + 1}",
                      media={"image": (MediaItem("image", array=rng.integers(0, 256, (28, 28, 3), np.uint8)),)}
                      if opening else {})
            for i in range(2)]
    # a random model rarely writes <eos>: any printable character ends its turns instead
    stops = tuple(tokenizer.convert_tokens_to_ids(list(string.ascii_letters + string.digits + string.punctuation)))
    params = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=stops, seed=3)
    return list(rollout.generate([(i, row, []) for i, row in enumerate(rows)], 2, params))


def _gap(trained_row: torch.Tensor, sample) -> float:
    """The largest gap between the trainer's and the engine's log-probs on the sample's policy tokens."""
    mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    return (trained_row[: len(sample.response_ids)][mask] - torch.tensor(sample.rollout_logprobs)[mask]).abs().max().item()


def test_an_image_shown_mid_trajectory_is_scored_by_the_trainer_as_the_engine_saw_it(tiny):
    model, tokenizer = tiny
    samples = _play(tiny)
    assert len(samples) == 4 and all(s.finish_reason == "stop" and s.agent_stats["turns"] == 2 for s in samples)
    for sample in samples:
        (shown,) = sample.observed_media
        # the observation's one placeholder became a block of one pad per merged patch, between the markers
        pads = int(shown["image_grid_thw"].prod()) // 4
        assert sample.response_ids.count(IMAGE_TOKEN_ID) == pads and VISION_START_ID in sample.response_ids
        assert all(m == 0.0 for token, m in zip(sample.response_ids, sample.loss_mask) if token == IMAGE_TOKEN_ID)
    for group in (0, 1):  # a group's opening media stays one object; what each trajectory was shown is its own
        first, second = (s for s in samples if s.group_id == group)
        assert first.media_inputs is second.media_inputs and first.observed_media[0] is not second.observed_media[0]
    batch = samples_to_batch(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        trained, _ = token_logprobs(model, batch, 1.0)
    assert max(_gap(trained[row], sample) for row, sample in enumerate(samples)) < 1e-4
    # the turns after the new image were compared, not only the first
    assert all(sum(sample.loss_mask[sample.response_ids.index(IMAGE_TOKEN_ID):]) >= 1 for sample in samples)


def test_with_another_image_in_its_place_the_trainer_would_disagree(tiny):
    """The check above can fail: the same trajectories scored with other pixels where the shown
    image was give other log-probs after it."""
    model, tokenizer = tiny
    samples = _play(tiny)
    for sample in samples:
        (shown,) = sample.observed_media
        sample.observed_media = ({**shown, "pixel_values": torch.randn_like(shown["pixel_values"])},)
    with torch.no_grad():
        trained, _ = token_logprobs(model, samples_to_batch(samples, tokenizer.pad_token_id), 1.0)
    gaps = [_gap(trained[row], sample) for row, sample in enumerate(samples)]
    assert max(gaps) > 1e-3


def test_a_text_row_can_be_shown_an_image_later(tiny):
    samples = _play(tiny, opening=False)
    assert all(s.finish_reason == "stop" and s.media_inputs is None and len(s.observed_media) == 1 for s in samples)
    model, tokenizer = tiny
    with torch.no_grad():
        trained, _ = token_logprobs(model, samples_to_batch(samples, tokenizer.pad_token_id), 1.0)
    assert max(_gap(trained[row], sample) for row, sample in enumerate(samples)) < 1e-4


@pytest.mark.parametrize(("options", "with_processor", "reason"), [
    ({"placeholders": 2, "items": 1}, True, r"observation after turn 1: 2 image placeholder token\(s\) .* but 1 image"),
    ({"placeholder": "<|image_pad|>", "items": 0}, True,
     r"observation after turn 1 holds the model's media token\(s\) \[126\] but shows no media"),
    ({"placeholder": "<|vision_start|><image>"}, True,  # a marker: the model would look for an item there
     r"observation after turn 1 holds the model's media token\(s\) \[124\]: write one placeholder"),
    ({"kind": "images"}, True, r"EnvStep.media has \['images'\]; its keys are image, audio, video"),
    ({}, False, r"shows media, but the run has no media processor: set data.media_keys"),
])
def test_media_the_environment_gets_wrong_fail_only_their_trajectory(tiny, options, with_processor, reason):
    samples = _play(tiny, options, with_processor=with_processor, opening=with_processor)
    assert len(samples) == 4
    for sample in samples:
        assert sample.finish_reason == "env_error" and sample.agent_stats["turns"] == 1
        assert "rows.jsonl:" in sample.metadata["env_error"]
        assert re.search(reason, sample.metadata["env_error"]), sample.metadata["env_error"]
