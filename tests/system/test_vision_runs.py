"""Image RL end to end on a tiny LLaVA and scikit-learn's digits: each prompt group's images are
processed once, stored once on the bus, and reach the rollout engine, the Reference and the
Actor; the language model stays frozen while the vision side trains (`train.trainable`)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from rlx.cli import main
from rlx.models import load_pretrained

from rlx.config import build_config
from rlx.models.vision import VISION_PARAMETERS
from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from rlx.orchestration.colocate import run_colocate
from rlx.orchestration.run_dir import latest_checkpoint

pytest.importorskip("sklearn")


def digits_config(model_path, tmp_path, **train):
    return build_config({
        "model": {"path": str(model_path)},
        "data": {"source": "digits", "train_size": 64, "eval_size": 16},
        "rollout": {"n": 4, "prompts_per_step": 4, "max_new_tokens": 3, "temperature": 1.0},
        "reward": {"name": "exact_match", "extract": "last_number"},
        "algorithm": {"kl_coef": 0.05},
        "train": {"steps": 3, "lr": 1e-2, "micro_batch_size": 8, "eval_every": 3, "checkpoint_every": 3,
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


@pytest.mark.slow  # a Ray cluster and a Serve deployment per role: about a minute here
def test_async_media_travel_the_ray_bus_once_per_group(tiny_vision_path, tmp_path):
    config = digits_config(tiny_vision_path, tmp_path, mode="async", max_staleness=0, steps=2, eval_every=0)
    run_dir = run_async(config, echo=lambda _: None)
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    assert steps and all(r["rollout_logprob_abs_diff"] < 1e-4 for r in steps)
