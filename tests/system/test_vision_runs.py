"""Image RL end to end on a tiny LLaVA and scikit-learn's digits: each prompt group's images are
processed once, stored once on the bus, and reach the rollout engine, the Reference and the
Actor; the language model stays frozen while the vision side trains (`train.trainable`). Colocated
runs only (they run beside the one-at-a-time tests): the async one is in test_async_mode.py."""

from __future__ import annotations

import json
import string

import pytest
from safetensors.torch import load_file

from rlx.cli import main
from rlx.config import build_config
from rlx.models import load_pretrained
from rlx.models.vision import VISION_PARAMETERS
from rlx.obs.metrics import read_metrics
from rlx.orchestration.colocate import run_colocate
from rlx.orchestration.run_dir import latest_checkpoint

pytest.importorskip("sklearn")


def digits_config(model_path, tmp_path, rollout=None, algorithm=None, **train):
    return build_config({
        "model": {"path": str(model_path)},
        "data": {"source": "digits", "train_size": 64, "eval_size": 16},
        "rollout": {"n": 4, "prompts_per_step": 4, "max_new_tokens": 3, "temperature": 1.0, **(rollout or {})},
        "reward": {"name": "exact_match", "extract": "last_number"},
        "algorithm": {"kl_coef": 0.05, **(algorithm or {})},
        "train": {"steps": 3, "lr": 1e-2, "micro_batch_size": 8, "eval_every": 3, "checkpoint_every": 3,
                  "check_bus_schema": True,
                  "trainable": list(VISION_PARAMETERS), **train},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False},
    })


def _weights(run_dir):
    return load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))


def test_a_colocated_run_sees_the_images_everywhere_and_trains_only_the_vision_side(tiny_vision_path, tmp_path,
                                                                                    capsys):
    run_dir = run_colocate(digits_config(tiny_vision_path, tmp_path), echo=lambda _: None)
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    assert steps and [r["step"] for r in records if "eval_accuracy" in r] == [0, 3]
    # on-policy in fp32: the trainer's log-probs equal the engine's only if it saw the same images,
    # and the Reference (the initial policy) agrees with the first step's policy only with them too
    assert all(r["rollout_logprob_abs_diff"] < 1e-4 for r in steps), [r["rollout_logprob_abs_diff"] for r in steps]
    assert steps[0]["step"] != 1 or abs(steps[0]["kl"]) < 1e-5
    initial, trained = load_file(str(tiny_vision_path / "model.safetensors")), _weights(run_dir)
    changed = {name for name in initial if not (initial[name] == trained[name]).all()}
    assert changed and all("vision_tower." in name or "multi_modal_projector." in name for name in changed), changed

    # the exported folder reloads with transformers' Auto classes; `rlx eval` scores the media task
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 0
    model, _ = load_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    projector = "multi_modal_projector.linear_1.weight"
    assert (model.model.multi_modal_projector.linear_1.weight == trained[projector]).all()
    capsys.readouterr()
    assert main(["eval", str(run_dir)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["eval_size"] == 16
    assert evaluated["eval_accuracy"] == [r for r in records if "eval_accuracy" in r][-1]["eval_accuracy"]


def test_a_multi_turn_run_carries_each_rows_image_into_every_turn_and_shows_a_new_one(tiny_vision_path, tmp_path):
    """A row's image opens its trajectories (processed once per group) and goes with every turn's
    request; the environment answers the first turn with an image of its own, which goes with every
    later request and reaches the trainer through the bus: the trainer's log-probs equal the
    engine's on every turn's policy tokens only if both saw both images with every turn."""
    from rlx.models import load_tokenizer

    agent = {"environment": "tests.integration.agent_envs:ShowsAnImage", "max_turns": 3,
             "max_trajectory_tokens": 80, "concurrency": 4}
    # a random tiny model rarely writes <eos>: any printable character ends its turns instead
    stops = load_tokenizer(tiny_vision_path).convert_tokens_to_ids(list(string.ascii_letters + string.digits))
    config = digits_config(tiny_vision_path, tmp_path, steps=2, eval_every=0, checkpoint_every=0,
                           rollout={"agent": agent, "stop_token_ids": stops, "prompts_per_step": 2,
                                    "max_new_tokens": 8},
                           # a random model rarely answers right: every group trains, on its KL term at least
                           algorithm={"filter_zero_std_groups": False})
    steps = [r for r in read_metrics(run_colocate(config, echo=lambda _: None)) if "loss" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["agent_turns_mean"] > 1.0 and 0.0 < record["agent_masked_token_fraction"] < 1.0
        assert record["agent_media_observations_mean"] > 0.5  # most trajectories were shown the second image
        assert record["rollout_logprob_abs_diff"] < 1e-4


def _mp4(path, digit: int, seconds: float = 2.0, rate: int = 8) -> None:
    """A clip of `seconds` whose frames show `digit` bright bars on a dark ground (56x56)."""
    import av
    import numpy as np

    frame = np.zeros((56, 56, 3), np.uint8)
    frame[:, : 5 * (digit + 1)] = 220
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
        for _ in range(int(seconds * rate)):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def test_a_qwen_vl_run_reads_videos_from_mp4_files_at_2_fps(tmp_path):
    pytest.importorskip("av")
    from rlx.config import DataConfig
    from rlx.data import load_splits
    from rlx.media.video import load_video
    from rlx.models.tiny_vl import build_tiny_vl

    model_path = build_tiny_vl(tmp_path / "tiny-qwen2-vl")
    rows = []
    for i in range(8):
        _mp4(tmp_path / f"clip{i}.mp4", i % 4)
        rows.append({"prompt": "<video>\nbars:", "label": str(i % 4 + 1), "videos": [f"clip{i}.mp4"]})
    (tmp_path / "videos.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = {"source": "jsonl", "path": str(tmp_path / "videos.jsonl"), "eval_path": str(tmp_path / "videos.jsonl"),
            "eval_size": 4, "media_keys": {"video": "videos"}, "apply_chat_template": False}
    train_rows, _ = load_splits(DataConfig(**data))
    frames = load_video(train_rows[0].media["video"][0], DataConfig(**data).media_limits, "clip0").frames
    assert len(frames) == 4 and frames[0].shape == (56, 56, 3)  # 2 s at the default 2 fps
    config = build_config({
        "model": {"path": str(model_path)}, "data": data,
        "rollout": {"n": 4, "prompts_per_step": 2, "max_new_tokens": 4},
        # a random model rarely answers right: every group trains (on its KL term) even with equal rewards
        "reward": {"name": "exact_match", "extract": "last_number"},
        "algorithm": {"kl_coef": 0.05, "filter_zero_std_groups": False},
        "train": {"steps": 2, "lr": 1e-3, "micro_batch_size": 4, "eval_every": 2},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False},
    })
    run_dir = run_colocate(config, echo=lambda _: None)
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    # the trainer's 3-D positions and video features match the engine's only if both saw the frames
    assert steps and all(r["rollout_logprob_abs_diff"] < 1e-4 for r in steps)
    assert [r["step"] for r in read_metrics(run_dir) if "eval_accuracy" in r] == [0, 2]
