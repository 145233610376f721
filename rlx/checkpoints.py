"""Checkpoint folders on disk: written whole or not at all, found again after any crash, exported by allowlist.

A checkpoint is one folder `step_NNNNNN` holding every stateful part of the run at that step (the
Actor, a colocated Critic in `critic/`, the run state). It is written into `step_NNNNNN.partial`;
its last file is the marker `rlx_checkpoint.json`, written after every other file and folder was
fsynced, so a folder with the marker is complete. A folder replacing an existing one of the same
step is swapped in by renames (old one to `.old`, new one in, `.old` deleted): whatever instant a
crash hits, a complete copy (old or new) stays findable (`newest_complete`).

This module imports nothing from the engines or the orchestration: both use it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlx.checkpoint_shards import is_sharded, read_whole
from rlx.errors import UserError

FORMAT = 2  # 1: the pickle `run_state.pkl` era, no marker
MARKER = "rlx_checkpoint.json"
STAGING, REPLACED = ".partial", ".old"
_STEP = re.compile(r"^step_~*(\d+)(\.partial|\.old)?$")  # `~`: one per digit past 6 (run_dir.step_name)

# What `rlx export` copies (fnmatch patterns on the checkpoint's top-level file names): the model
# and what loading or prompting it needs. Everything else (optimizer, run state with bus rows,
# prompts and responses, the Critic) stays behind. A feature that adds an exportable file
# registers its pattern here.
EXPORT_PATTERNS: list[str] = [
    "model*.safetensors", "model.safetensors.index.json",  # weights (one file or shards + index)
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "*.model",  # BPE / WordPiece / SentencePiece vocabularies
    "chat_template.jinja", "chat_template.json",
    "*processor*config.json", "preprocessor_config.json",
]


class CheckpointError(UserError):
    """A checkpoint folder rlx cannot use as it is; the message says why and what to do."""


def legacy_message(folder: Path, run_dir: Path) -> str:
    return (f"{folder} is a checkpoint in the old format (no {MARKER}; run state as a pickle, which rlx no "
            f"longer loads because a pickle can run code). Convert the run once with `rlx convert-run {run_dir}` "
            "(it trusts and loads those pickles), then try again")


# -- writing -------------------------------------------------------------------------------------
def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Every file, then every folder (innermost first), durably on disk."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync_path(Path(root) / name)
        _fsync_path(Path(root))


def write_marker(folder: Path) -> None:
    """The completion marker, written last and fsynced with its folder; renamed into place, so a
    reader never sees half of it."""
    draft = folder / (MARKER + ".tmp")
    with open(draft, "w") as out:
        out.write(json.dumps({"format": FORMAT}))
        out.flush()
        os.fsync(out.fileno())
    draft.rename(folder / MARKER)
    _fsync_path(folder)


def _discard(folder: Path) -> None:
    """Delete a folder, its marker first: a crash halfway never leaves a partial folder that looks complete."""
    if folder.exists():
        (folder / MARKER).unlink(missing_ok=True)
        shutil.rmtree(folder)


def _settle(final: Path) -> None:
    """Finish whatever a crashed save left: a complete `.partial` or `.old` takes the place of a
    missing `final` (the newer first); then leftovers go. Afterwards only `final` may exist."""
    staging, replaced = final.with_name(final.name + STAGING), final.with_name(final.name + REPLACED)
    if not final.exists():
        complete = next((c for c in (staging, replaced) if is_complete(c)), None)
        if complete is not None:
            complete.rename(final)
    _discard(staging)
    _discard(replaced)
    _fsync_path(final.parent)


@contextmanager
def staged_checkpoint(final: Path) -> Iterator[Path]:
    """Yield an empty staging folder to write a checkpoint into; on success mark it complete and
    swap it in for `final`. On an error the staging folder goes and `final` is untouched."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _settle(final)
    staging = final.with_name(final.name + STAGING)
    staging.mkdir()
    try:
        yield staging
        fsync_tree(staging)
        write_marker(staging)
    except OSError as exc:
        _discard(staging)
        raise OSError(f"could not write checkpoint {final}: {exc} "
                      "(free disk space or set logging.run_dir)") from exc
    except BaseException:
        _discard(staging)
        raise
    _swap_in(staging, final)


def _swap_in(staging: Path, final: Path) -> None:
    replaced = final.with_name(final.name + REPLACED)
    if final.exists():
        final.rename(replaced)
        _fsync_path(final.parent)
    staging.rename(final)
    _fsync_path(final.parent)
    _discard(replaced)


# -- reading -------------------------------------------------------------------------------------
def read_marker(folder: Path) -> dict | None:
    """The folder's marker (None: none, an incomplete checkpoint); a newer format is an error."""
    path = folder / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
        version = marker["format"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a valid checkpoint marker ({exc}); delete {folder} "
                              "to fall back to the previous checkpoint") from exc
    if version != FORMAT:
        raise CheckpointError(f"{folder} has checkpoint format {version}; this rlx reads format {FORMAT}: "
                              "use the rlx version that wrote it")
    return marker


def is_complete(folder: Path) -> bool:
    return folder.is_dir() and read_marker(folder) is not None


def is_legacy(folder: Path) -> bool:
    """A finished checkpoint of the old format: a final-named folder with trainer state but no marker
    (the new format never renames a folder into place before its marker exists)."""
    return (_STEP.match(folder.name) is not None and not folder.name.endswith((STAGING, REPLACED))
            and not (folder / MARKER).exists() and (folder / "trainer_state.json").exists())


def newest_complete(folder: Path, run_dir: Path) -> Path | None:
    """The newest complete checkpoint among `folder`'s `step_*` folders. Per step, the final
    name wins, then a complete `.partial` (a swap cut short: the new copy), then `.old`.
    Incomplete folders are skipped; an old-format one is an error naming the converter."""
    steps: dict[int, list[Path]] = {}
    for path in folder.glob("step_*") if folder.is_dir() else []:
        match = _STEP.match(path.name)
        if match and path.is_dir():
            if is_legacy(path):
                raise CheckpointError(legacy_message(path, run_dir))
            steps.setdefault(int(match.group(1)), []).append(path)
    order = {"": 0, STAGING: 1, REPLACED: 2}
    for step in sorted(steps, reverse=True):
        for path in sorted(steps[step], key=lambda p: order[_STEP.match(p.name).group(2) or ""]):
            if is_complete(path):
                return path
    return None


def settled(path: Path) -> Path:
    """`path` under its final name: a `.partial` or `.old` checkpoint that `newest_complete` chose
    (a save cut short by a crash) takes its step's name, and the other leftovers go. For a run
    that continues from it, so the next saves and resumes see one checkpoint per step."""
    match = _STEP.match(path.name)
    if match is None:
        return path
    final = path.with_name(path.name.removesuffix(match.group(2) or ""))
    _settle(final)
    return final


# -- export --------------------------------------------------------------------------------------
def exportable(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in EXPORT_PATTERNS)


def export_checkpoint(source: Path, out: Path) -> list[str]:
    """Copy the allowlisted top-level files of checkpoint `source` into `out`; returns their names. A
    link whose target lies outside the checkpoint is refused (the target could be anyone's file)."""
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise CheckpointError(f"export target {out} is inside the checkpoint {source}: choose a folder outside it")
    if (source / "trainer_state.json").exists() and read_marker(source) is None:
        raise CheckpointError(f"{source} is not a complete checkpoint (no {MARKER}): a save cut short, or the old "
                              "format (`rlx convert-run <run_dir>` converts it); export another checkpoint")
    names = sorted(p.name for p in source.iterdir() if p.is_file() and exportable(p.name))
    for name in names:  # a link out of the checkpoint (tokenizer.json -> ~/.ssh/id_rsa) must not be published
        target = (source / name).resolve()
        if (source / name).is_symlink() and source.resolve() not in target.parents:
            raise CheckpointError(f"{source / name} is a link to {target}, outside the checkpoint: rlx exports only "
                                  "files inside it; replace the link by the file itself if you mean to publish it")
    sharded = is_sharded(source)
    if not sharded and not any(fnmatch.fnmatchcase(n, "model*.safetensors") for n in names):
        raise CheckpointError(f"{source} has no model*.safetensors: it is not a checkpoint folder")
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy2((source / name).resolve(), out / name)
    if sharded:  # a rank group's checkpoint: the ranks' slices joined into whole tensors
        from safetensors.torch import save_file

        save_file(read_whole(source, "model/"), out / "model.safetensors", metadata={"format": "pt"})
        names = sorted([*names, "model.safetensors"])
    return names
