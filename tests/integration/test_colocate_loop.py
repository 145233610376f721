"""The colocated loop end to end on a tiny model: it learns, checkpoints, and resumes exactly."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from rlx.config import build_config
from rlx.obs.metrics import read_metrics
from rlx.obs.trace import read_trace, startup_parts
from rlx.orchestration.colocate import run_colocate


def toy_config(tiny_path, tmp_path, **overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "toy.jsonl"
    if not data.exists():
        rows = [{"prompt": f"say a {i}:", "label": "a", "metadata": {"index": i}} for i in range(64)]
        data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    raw = {
        "model": {"path": str(tiny_path)},
        "data": {"source": "jsonl", "path": str(data), "eval_path": str(data), "eval_size": 16},
        "rollout": {"n": 8, "prompts_per_step": 4, "max_new_tokens": 8, "temperature": 1.0},
        "reward": {"name": "tests.integration.toy_task:count_a"},
        # check_bus_schema: the run's bus holds every put to its FieldSpec (a debug setting, on in tests)
        "train": {"steps": 25, "lr": 3e-3, "micro_batch_size": 16, "eval_every": 0, "check_bus_schema": True},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False},
    }
    for key, value in overrides.items():
        section, leaf = key.split("__")
        raw.setdefault(section, {})[leaf] = value
    return build_config(raw)


def test_tiny_model_learns_toy_task(tiny_path, tmp_path):
    run_dir = run_colocate(toy_config(tiny_path, tmp_path), echo=lambda _: None)
    records = read_metrics(run_dir)
    rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
    evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    assert len(rewards) == 25
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards
    assert evals[-1] > evals[0] + 0.3, evals
    assert (run_dir / "training.png").stat().st_size > 1000
    assert (run_dir / "config.yaml").exists()
    last = [r for r in records if "loss" in r][-1]
    for key in ("reward_mean", "loss", "entropy", "clip_fraction", "response_length", "gen_tokens_per_s",
                "time_rollout_s", "time_train_s", "train_tokens_per_s"):
        assert key in last, key
    parts, first_step_s = startup_parts(read_trace(run_dir))  # start-up, part by part
    assert [name for name, _ in parts] == ["load_data driver", "start reward", "start rollout", "start actor",
                                           "evaluate driver"]
    assert all(seconds >= 0 for _, seconds in parts) and first_step_s >= sum(seconds for _, seconds in parts)


def test_resume_continues_with_same_data_order_and_weights(tiny_path, tmp_path):
    straight = run_colocate(toy_config(tiny_path, tmp_path / "a", train__steps=4), echo=lambda _: None)
    interrupted = toy_config(tiny_path, tmp_path / "b", train__steps=2)
    run_colocate(interrupted, echo=lambda _: None)
    resumed = run_colocate(toy_config(tiny_path, tmp_path / "b", train__steps=4), resume=True, echo=lambda _: None)

    state_a = json.loads((straight / "checkpoints/step_000004/trainer_state.json").read_text())
    state_b = json.loads((resumed / "checkpoints/step_000004/trainer_state.json").read_text())
    assert state_a["data_position"] == state_b["data_position"] == 16
    assert state_a["totals"] == state_b["totals"]
    weights_a = load_file(straight / "checkpoints/step_000004/model.safetensors")
    weights_b = load_file(resumed / "checkpoints/step_000004/model.safetensors")
    for name in weights_a:
        assert torch.allclose(weights_a[name], weights_b[name], atol=1e-6), name
    rewards_a = [r["reward_mean"] for r in read_metrics(straight) if "reward_mean" in r]
    rewards_b = [r["reward_mean"] for r in read_metrics(resumed) if "reward_mean" in r]
    assert rewards_a == rewards_b


def test_kl_to_reference_flows_through_the_reference_role(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, train__steps=3, algorithm__kl_coef=0.5, algorithm__kl_type="k3")
    records = read_metrics(run_colocate(config, echo=lambda _: None))
    kls = [r["kl"] for r in records if "kl" in r]
    assert len(kls) >= 2 and abs(kls[0]) < 1e-6  # the first step starts at the reference
    assert max(kls[1:]) > 0  # after an update the policy has moved away from the reference
    assert all("time_reference_s" in r for r in records if "kl" in r)


def test_a_reference_that_follows_the_policy_is_reset_every_n_steps(tiny_path, tmp_path):
    """kl_reference_refresh_every=2: after the weights of steps 2 and 4 are published the reference
    takes them, so the next step's (on-policy) samples are scored against their own policy: KL 0."""
    config = toy_config(tiny_path, tmp_path, train__steps=6, algorithm__kl_coef=0.5,
                        algorithm__kl_reference_refresh_every=2)
    kls = [r["kl"] for r in read_metrics(run_colocate(config, echo=lambda _: None)) if "kl" in r]
    assert len(kls) == 6
    assert all(abs(kls[step - 1]) < 1e-6 for step in (1, 3, 5)), kls  # right after a reset
    assert all(kls[step - 1] > 1e-6 for step in (2, 4, 6)), kls  # one update away from it


def test_the_actor_trains_in_whole_micro_batches_whatever_the_filter_drops(tiny_path, tmp_path):
    """Groups of equal rewards are dropped from the bus's micro-batches; the rows left are gathered
    into whole micro-batches (each pass costs a constant besides its rows), the remainder last."""
    config = toy_config(tiny_path, tmp_path, train__steps=4, train__micro_batch_size=12)  # groups of 8 straddle them
    run_dir = run_colocate(config, echo=lambda _: None)
    trained = {r["step"]: int(r["trained_samples"]) for r in read_metrics(run_dir) if "trained_samples" in r}
    passes: dict[int, list[int]] = {}
    for span in read_trace(run_dir).spans:
        if span.name == "train" and "rows" in span.args:
            passes.setdefault(span.args["step"], []).append(span.args["rows"])
    assert any(0 < count < 32 for count in trained.values()), trained  # the filter dropped some groups
    for step, count in trained.items():
        full, rest = divmod(count, 12)
        assert sorted(passes.get(step, []), reverse=True) == [12] * full + ([rest] if rest else []), (step, passes)
