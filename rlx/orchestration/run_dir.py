"""The run directory: resolved config, metrics, checkpoints, plots.

rlx marks every run directory it creates with `.rlx-run`; `--overwrite` deletes only such a
directory, so a mistyped `logging.run_dir` can never wipe someone's files.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import torch

from rlx.checkpoints import CheckpointError, fsync_tree, is_legacy, newest_complete, settled, write_marker
from rlx.config import RunConfig
from rlx.errors import UserError
from rlx.run_state import LEGACY_FILE, save_run_state

CHECKPOINTS = "checkpoints"
RUN_MARKER = ".rlx-run"


class RunDirError(UserError):
    """The run directory is not in the state the command needs."""


def prepare_run_dir(config: RunConfig, resume: bool, overwrite: bool) -> Path:
    run_dir = config.run_dir
    if run_dir.exists() and not resume:
        if not overwrite:
            raise RunDirError(f"run directory {run_dir} already exists: pass --resume to continue it, "
                              "--overwrite to replace it, or set logging.name=<new name>")
        empty_run_dir(run_dir)
    if resume and latest_checkpoint(run_dir) is None:
        raise RunDirError(f"--resume: no checkpoint in {run_dir / CHECKPOINTS}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_MARKER).touch()
    write_private(run_dir / "config.yaml", config.to_yaml(redact=True))
    return run_dir


def write_private(path: Path, text: str) -> None:
    """`text` into `path`, readable by its owner only (a config names data, models and endpoints)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file (a resumed run) keeps its mode otherwise
    with os.fdopen(fd, "w") as out:
        out.write(text)


def _refuse_overwrite(run_dir: Path) -> str | None:
    """Why `--overwrite` must not delete `run_dir`; None when it may."""
    where = run_dir.resolve()
    if run_dir.is_symlink() or not run_dir.is_dir():
        return "it is a symlink or not a directory"
    if where == Path(where.anchor) or where == Path.home().resolve():
        return "it is the filesystem root or your home directory"
    if where == Path.cwd().resolve() or where in Path.cwd().resolve().parents:
        return "it is the working directory or one of its parents"
    if not (run_dir / RUN_MARKER).is_file():
        return (f"rlx did not create it (no {RUN_MARKER} file inside; a run directory of an older rlx gets one "
                f"from `rlx convert-run {run_dir}`)")
    return None


def empty_run_dir(run_dir: Path) -> None:
    """`--overwrite`: delete everything in a run directory rlx made, its marker last (an interrupted
    delete can be repeated). An empty directory is simply reused."""
    if run_dir.is_dir() and not run_dir.is_symlink() and not any(run_dir.iterdir()):
        return
    reason = _refuse_overwrite(run_dir)
    if reason is not None:
        raise RunDirError(f"--overwrite refuses to delete {run_dir} ({run_dir.resolve()}): {reason}. "
                          "Choose a directory of its own with logging.run_dir=<path> or logging.name=<name>")
    for child in run_dir.iterdir():
        if child.name == RUN_MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def checkpoint_path(run_dir: Path, step: int, role: str | None = None) -> Path:
    """The run's checkpoint of `step`; `role`: a stateful role that checkpoints on its own clock
    (the async Critic), in a folder of its own."""
    return run_dir / CHECKPOINTS / (role or "") / step_name(step)


def step_name(step: int) -> str:
    """`step_000042`; past 999,999 a `~` per extra digit (`step_~1000000`), so names sort by step."""
    return f"step_{'~' * max(0, len(str(step)) - 6)}{step:06d}"


def latest_checkpoint(run_dir: Path, role: str | None = None, resuming: bool = False) -> Path | None:
    """The newest complete checkpoint (incomplete ones, without their marker, are skipped; an
    old-format one is an error naming `rlx convert-run`). `resuming`: the run continues from it, so
    a save a crash cut short is finished first (`settled`); readers (eval, export) change nothing."""
    newest = newest_complete(run_dir / CHECKPOINTS / (role or ""), run_dir)
    return settled(newest) if resuming and newest is not None else newest


# -- converting a run directory of the old format ------------------------------------------------
def _legacy_checkpoints(run_dir: Path) -> list[Path]:
    folder = run_dir / CHECKPOINTS
    found = [p for pattern in ("step_*", "*/step_*") for p in folder.glob(pattern)]
    return sorted(p for p in found if p.is_dir() and is_legacy(p))


def _convert_optimizer(path: Path) -> None:
    """Re-save a trusted optimizer file so that it loads with `weights_only=True`, or say why not."""
    state = torch.load(path, weights_only=False)
    staging = path.with_name(path.name + ".new")
    torch.save(state, staging)
    try:
        torch.load(staging, weights_only=True)
    except Exception as exc:
        staging.unlink()
        raise CheckpointError(f"{path} holds more than tensors and plain data ({exc}): "
                              "it cannot be converted") from exc
    staging.replace(path)


def convert_checkpoint(folder: Path) -> None:
    """One old-format checkpoint, in place: the pickle becomes JSON + safetensors, optimizer files
    are made `weights_only`-loadable, then the marker; the pickle goes last. Interrupted, it can
    simply run again (without the marker the folder still counts as old)."""
    for optimizer in sorted(folder.rglob("optimizer.pt")):
        _convert_optimizer(optimizer)
    legacy = folder / LEGACY_FILE
    if legacy.exists():
        with open(legacy, "rb") as source:
            save_run_state(folder, pickle.load(source))  # trusted: the user asked for this conversion
    fsync_tree(folder)
    write_marker(folder)
    legacy.unlink(missing_ok=True)


def convert_run(run_dir: Path) -> list[Path]:
    """Convert every old-format checkpoint of `run_dir` and mark it a run directory; returns the
    checkpoints converted."""
    if not (run_dir / "config.yaml").is_file() or not (run_dir / CHECKPOINTS).is_dir():
        raise RunDirError(f"{run_dir} is not a run directory (it needs config.yaml and {CHECKPOINTS}/)")
    converted = _legacy_checkpoints(run_dir)
    for folder in converted:
        convert_checkpoint(folder)
    (run_dir / RUN_MARKER).touch()
    return converted
