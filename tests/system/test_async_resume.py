"""Two crashes of one async run, each followed by `--resume`; the run ends with no sample lost or
trained twice. The run is PPO, so its Critic resumes too, from its own checkpoint.

1. SIGKILL of the whole run (driver, Ray, every service), in the middle of an Actor checkpoint
   (its `.partial` folder exists), at a checkpoint drawn from a seed.
2. The resumed run's bus actor is killed (`ray.kill`, an injected fault, `faults` role `bus`) once
   the driver has seen a step drawn from the same seed (its services start working before the
   driver's loop does, so it may see a later one first; the log says which): the run stops, naming
   the bus and `--resume`.
Then `--resume` again runs to the end. The seed comes from RLX_KILL_SEED (else it is drawn) and is
printed with each kill instant, so a failure can be replayed."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlx.config import FaultConfig
from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from rlx.orchestration.health import RoleFailed
from rlx.orchestration.run_dir import checkpoint_path, latest_checkpoint
from tests.integration.test_colocate_loop import toy_config
from tests.system.test_fault_tolerance import short_groups

REPO = Path(__file__).resolve().parents[2]
STEPS = 16
EVERY = 3  # checkpoint interval: the SIGKILL lands in the save of step 6 or 9, after an earlier one


def sigkill_mid_checkpoint(config_file: Path, run_dir: Path, step: int) -> str:
    """Start `rlx train` as its own process group; SIGKILL the group while the Actor's checkpoint of
    `step` is being written. Returns what the kill hit (a save too quick to see is killed right
    after it: said so)."""
    rlx = Path(sys.executable).parent / "rlx"
    job = subprocess.Popen([str(rlx), "train", str(config_file)], cwd=REPO, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staging, done = checkpoint_path(run_dir, step).with_suffix(".partial"), checkpoint_path(run_dir, step)
    run = psutil.Process(job.pid)
    started: set[psutil.Process] = set()  # every process of the run seen so far: Ray's leave the group
    try:
        deadline, seen_at = time.monotonic() + 300, 0.0
        while not staging.exists() and not done.exists():
            assert job.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, f"no checkpoint of step {step} within 300 s"
            if time.monotonic() > seen_at:
                started |= set(run.children(recursive=True))
                seen_at = time.monotonic() + 0.5
            time.sleep(0.001)
        started |= set(run.children(recursive=True))
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        # a replica Ray started outside the group must not finish a checkpoint after the "crash"
        for process in started:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(started, timeout=30)
    return f"mid-save of {staging.name}" if staging.exists() else f"right after the save of step {step}"


def test_two_crashes_then_resume_lose_and_repeat_nothing(tiny_path, tmp_path):
    seed = int(os.environ.get("RLX_KILL_SEED", random.randrange(10**6)))
    draw = random.Random(seed)
    config = toy_config(tiny_path, tmp_path, train__steps=STEPS, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2, train__checkpoint_every=EVERY, algorithm__advantage="gae")
    config_file = tmp_path / "run.yaml"
    config_file.write_text(config.to_yaml())
    run_dir = Path(config.logging.run_dir)

    save = draw.choice([2 * EVERY, 3 * EVERY])
    hit = sigkill_mid_checkpoint(config_file, run_dir, save)
    # what the resume starts from: a cut save whose files are all written is finished first (`settled`)
    killed_at = latest_checkpoint(run_dir, resuming=True)
    critic_killed_at = latest_checkpoint(run_dir, "critic", resuming=True)
    assert killed_at is not None and critic_killed_at is not None
    print(f"RLX_KILL_SEED={seed}: SIGKILL {hit}; resuming from {killed_at.name}, critic {critic_killed_at.name}")
    assert int(killed_at.name.split("_")[1]) in (save - EVERY, save)  # the old one, or the new one if it finished
    written_before = len(read_metrics(run_dir))

    bus_kill = save + draw.randint(2, 4)
    print(f"RLX_KILL_SEED={seed}: the bus actor is killed after step {bus_kill}")
    config.faults = [FaultConfig(role="bus", at_step=bus_kill, kind="kill")]
    with pytest.raises(RoleFailed, match=r"the run's bus actor died after step \d+ \(the bus actor held every row "
                                         r"not trained yet\); the run stops here: `rlx train <config> --resume` "
                                         r"continues from its newest checkpoint \(step_\d+\)"):
        run_async(config, resume=True, echo=print)
    # the Critic went on from its own newest checkpoint, not from its initial weights
    resumed = read_metrics(run_dir)[written_before:]
    critic_steps = [int(r["critic_step"]) for r in resumed if "critic_step" in r]
    assert critic_steps[0] == int(critic_killed_at.name.split("_")[1]) + 1, critic_steps

    config.faults = []
    run_async(config, resume=True, echo=print)

    final = latest_checkpoint(run_dir)
    assert final.name == f"step_{STEPS:06d}"
    # every group handed out is trained exactly n times or still on the bus: none lost, none twice
    assert short_groups(run_dir, config.rollout.n) == {}
