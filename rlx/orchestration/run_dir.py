"""The run directory: resolved config, metrics, checkpoints, plots."""

from __future__ import annotations

import shutil
from pathlib import Path

from rlx.config import RunConfig
from rlx.errors import UserError

CHECKPOINTS = "checkpoints"


class RunDirError(UserError):
    """The run directory is not in the state the command needs."""


def prepare_run_dir(config: RunConfig, resume: bool, overwrite: bool) -> Path:
    run_dir = config.run_dir
    if run_dir.exists() and not resume:
        if not overwrite:
            raise RunDirError(f"run directory {run_dir} already exists: pass --resume to continue it, "
                              "--overwrite to replace it, or set logging.name=<new name>")
        shutil.rmtree(run_dir)
    if resume and latest_checkpoint(run_dir) is None:
        raise RunDirError(f"--resume: no checkpoint in {run_dir / CHECKPOINTS}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config.to_yaml())
    return run_dir


def checkpoint_path(run_dir: Path, step: int, role: str | None = None) -> Path:
    """The run's checkpoint of `step`; `role`: a stateful role that checkpoints on its own clock
    (the async Critic), in a folder of its own."""
    return run_dir / CHECKPOINTS / (role or "") / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path, role: str | None = None) -> Path | None:
    """The newest complete checkpoint (staging folders end in .partial and are ignored)."""
    folder = run_dir / CHECKPOINTS / (role or "")
    done = sorted(p for p in folder.glob("step_*") if not p.name.endswith(".partial")) if folder.exists() else []
    return done[-1] if done else None
