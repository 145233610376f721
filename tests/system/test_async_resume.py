"""SIGKILL of a whole async run (driver, Ray, every service), then `--resume`: the run continues
from its last checkpoint, with the bus and the prompt source as they were, and no sample is lost
or trained twice. The run is PPO, so its Critic resumes too, from its own checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from rlx.orchestration.run_dir import latest_checkpoint
from rlx.run_state import load_run_state
from tests.integration.test_colocate_loop import toy_config

REPO = Path(__file__).resolve().parents[2]
STEPS = 24  # killed at the first checkpoints (step 4 or 8): the resumed run does most of them


def test_sigkill_then_resume_loses_and_repeats_nothing(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, train__steps=STEPS, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2, train__checkpoint_every=4, algorithm__advantage="gae")
    config_file = tmp_path / "run.yaml"
    config_file.write_text(config.to_yaml())
    run_dir = Path(config.logging.run_dir)

    rlx = Path(sys.executable).parent / "rlx"
    job = subprocess.Popen([str(rlx), "train", str(config_file)], cwd=REPO, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        # the first periodic checkpoints of the Actor and of the Critic, mid-run
        while latest_checkpoint(run_dir) is None or latest_checkpoint(run_dir, "critic") is None:
            assert job.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.1)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the driver and every process it started, mid-run
        job.wait()
    killed_at, critic_killed_at = latest_checkpoint(run_dir), latest_checkpoint(run_dir, "critic")
    written_before = len(read_metrics(run_dir))

    run_async(config, resume=True, echo=print)

    final = latest_checkpoint(run_dir)
    assert final.name == f"step_{STEPS:06d}" and int(killed_at.name.split("_")[1]) < STEPS
    counts = load_run_state(final)["samples_per_group"]
    n = config.rollout.n
    assert max(counts.values()) <= n  # no sample trained twice, across the crash
    assert sum(counts.values()) == STEPS * 16  # every step trained on exactly its 16 rows
    # none lost: below the last few groups (still in flight at the end), every group arrived whole
    settled = max(counts) - 2 * (config.train.max_staleness + 2) * config.rollout.prompts_per_step
    assert all(counts.get(g) == n for g in range(settled)), sorted(counts.items())
    # the Critic went on from its own newest checkpoint, not from its initial weights
    resumed = read_metrics(run_dir)[written_before:]
    critic_steps = [int(r["critic_step"]) for r in resumed if "critic_step" in r]
    assert critic_steps[0] == int(critic_killed_at.name.split("_")[1]) + 1, critic_steps
