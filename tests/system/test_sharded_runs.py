"""Whole runs with the Actor over 2 FSDP2 ranks: colocated (learns, resumes from its sharded
checkpoint, exports a folder transformers loads) and async (the Actor service owns the rank group,
and survives losing a rank)."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import torch

from rlx.checkpoint_shards import INDEX, read_whole, shard_name
from rlx.checkpoints import export_checkpoint
from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from rlx.orchestration.colocate import run_colocate
from tests.integration.test_colocate_loop import toy_config

TWO_RANKS = {"ranks": 2, "num_cpus": 0.5}


@pytest.mark.slow
def test_colocated_run_on_two_ranks_learns_resumes_and_exports(tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM

    config = toy_config(tiny_path, tmp_path, resources__actor=TWO_RANKS, train__steps=20, train__checkpoint_every=10)
    run_dir = run_colocate(config, echo=lambda _: None)
    evals = [r["eval_accuracy"] for r in read_metrics(run_dir) if "eval_accuracy" in r]
    assert evals[-1] > evals[0] + 0.3, evals  # as the one-process run of the same task
    checkpoint = run_dir / "checkpoints" / "step_000020"
    assert (checkpoint / INDEX).is_file() and (checkpoint / shard_name(1, 2)).is_file()
    assert not (checkpoint / "model.safetensors").exists()  # no rank wrote the whole model

    resumed = toy_config(tiny_path, tmp_path, resources__actor=TWO_RANKS, train__steps=22)
    run_colocate(resumed, resume=True, echo=lambda _: None)
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == list(range(1, 23))  # 20, then 2 more from the checkpoint

    exported = export_checkpoint(run_dir / "checkpoints" / "step_000022", tmp_path / "export")
    assert "model.safetensors" in exported and "config.json" in exported
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    whole = read_whole(run_dir / "checkpoints" / "step_000022", "model/")
    assert torch.equal(model.state_dict()["model.layers.0.mlp.up_proj.weight"], whole["model.layers.0.mlp.up_proj.weight"])
    assert not [p for p in psutil.process_iter(["name"]) if "RankProcess" in (p.info["name"] or "")]
    assert not psutil.Process().children()  # the local Ray cluster the run started is gone too


@pytest.mark.slow
def test_a_dead_rank_fails_its_group_and_the_actor_recovers_globally(tiny_path, tmp_path):
    """An async run with the Actor's service owning a 2-rank group, which is one fault domain: a
    rank process killed mid-run (SIGKILL, a real process death) fails the Actor's next call; its
    replica is replaced, builds a new group and resumes from the last sharded checkpoint, and the
    run completes with nothing trained twice and the engines on the last published version."""
    from tests.system.test_fault_tolerance import paced_async_config, recovered_globally

    config = paced_async_config(tiny_path, tmp_path, train__checkpoint_every=4, resources__actor=TWO_RANKS)
    metrics = tmp_path / "run" / "metrics.jsonl"
    killed: list[int] = []

    def kill_a_rank_after_step_6() -> None:
        while not killed:
            steps = [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] if metrics.exists() else []
            ranks = [p for p in psutil.process_iter(["cmdline"]) if "RankProcess" in " ".join(p.info["cmdline"] or [])]
            if steps and max(steps) >= 6 and ranks:
                ranks[-1].kill()
                killed.append(ranks[-1].pid)
            time.sleep(0.2)

    threading.Thread(target=kill_a_rank_after_step_6, daemon=True).start()
    run_dir = run_async(config, echo=print)
    assert killed
    health, _ = recovered_globally(run_dir, "actor")
    assert health["weights"]["rollbacks"][0][1] in (4, 8)  # back to a sharded checkpoint
    assert read_metrics(run_dir)[-1]["eval_weight_version"] == 12  # the engines got the new group's versions
    assert (run_dir / "checkpoints" / "step_000012" / shard_name(1, 2)).is_file()
