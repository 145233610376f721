"""Checkpoint folders: complete or not there, findable after a crash at any instant, one unit for
several engines, exported by allowlist, and old-format run directories converted."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.checkpoints import (
    EXPORT_PATTERNS,
    MARKER,
    CheckpointError,
    export_checkpoint,
    newest_complete,
    settled,
    staged_checkpoint,
)
from rlx.config import TrainConfig
from rlx.engines.training.engine import TrainingEngine
from rlx.orchestration.run_dir import checkpoint_path, convert_run, latest_checkpoint
from rlx.run_state import LEGACY_FILE, STATE_FILE, load_run_state

FILES = ("a.txt", "b.txt", "sub/c.txt")


def write_version(folder: Path, version: str) -> None:
    for name in FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(version)


def version_of(folder: Path) -> str:
    """The one version every file of the checkpoint holds (a mix would be a torn checkpoint)."""
    versions = {(folder / name).read_text() for name in FILES}
    assert len(versions) == 1, (folder, versions)
    return versions.pop()


def save(final: Path, version: str) -> None:
    with staged_checkpoint(final) as staging:
        write_version(staging, version)


def crash_at(k: int, final: Path, version: str) -> int:
    """In a forked child, save `version` into `final`, dying (os._exit: no cleanup runs, as with
    SIGKILL) at the k-th file-system step; returns the child's exit code (0: it finished).
    Fault injection: the wrapped functions are real, the child only stops before step k."""
    pid = os.fork()
    if pid == 0:
        steps = {"n": 0}

        def step(real, half_done=None):
            def wrapped(*args, **kwargs):
                if steps["n"] == k:
                    if half_done is not None:
                        half_done(*args)  # a delete cut short halfway
                    os._exit(17)
                steps["n"] += 1
                return real(*args, **kwargs)
            return wrapped

        def delete_one_file(folder, *_):
            next(p for p in Path(folder).rglob("*") if p.is_file()).unlink()

        Path.rename = step(Path.rename)
        Path.unlink = step(Path.unlink)
        Path.write_text = step(Path.write_text)
        os.fsync = step(os.fsync)
        shutil.rmtree = step(shutil.rmtree, delete_one_file)
        try:
            save(final, version)
        finally:
            os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_crash_at_any_step_of_a_resave_leaves_the_old_or_the_new_checkpoint(tmp_path):
    seen, k = set(), 0
    while True:
        folder = tmp_path / f"crash_{k}"
        final = folder / "step_000005"
        save(final, "old")
        save(folder / "step_000004", "older")
        code = crash_at(k, final, "new")
        found = newest_complete(folder, tmp_path)
        assert found is not None and found.name.startswith("step_000005"), (k, found)
        version = version_of(found)
        seen.add(version)
        resumed = settled(found)  # a run resuming from it finishes the cut-short save first
        assert resumed == final and version_of(final) == version, k
        assert sorted(p.name for p in folder.iterdir()) == ["step_000004", "step_000005"], k
        save(final, "again")  # the next save of that step replaces it whole
        assert sorted(p.name for p in folder.iterdir()) == ["step_000004", "step_000005"], k
        assert version_of(final) == "again" and (final / MARKER).exists()
        if code == 0:
            break
        assert code == 17
        k += 1
    assert seen == {"old", "new"} and k > 10  # both outcomes occur across the crash points


def test_incomplete_checkpoints_are_skipped_and_old_ones_name_the_converter(tmp_path):
    run_dir = tmp_path / "run"
    save(checkpoint_path(run_dir, 3), "three")
    staging = checkpoint_path(run_dir, 4).with_name("step_000004.partial")  # a save that died midway
    write_version(staging, "four")
    (checkpoint_path(run_dir, 5)).mkdir()  # an empty folder is not a checkpoint either
    assert latest_checkpoint(run_dir) == checkpoint_path(run_dir, 3)

    legacy = checkpoint_path(run_dir, 6)
    legacy.mkdir()
    (legacy / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"`rlx convert-run {run_dir}`"):
        latest_checkpoint(run_dir)


def test_a_newer_format_is_refused_by_name(tmp_path):
    save(tmp_path / "step_000001", "x")
    (tmp_path / "step_000001" / MARKER).write_text(json.dumps({"format": 3}))
    with pytest.raises(CheckpointError, match="format 3; this rlx reads format 2"):
        newest_complete(tmp_path, tmp_path)


@pytest.fixture()
def engines(tiny, tiny_path):
    from rlx.models import load_pretrained

    model, tokenizer = tiny
    critic_model, _ = load_pretrained(tiny_path)
    return (TrainingEngine(model, tokenizer, TrainConfig(), 1.0),
            TrainingEngine(critic_model, tokenizer, TrainConfig(), 1.0))


def test_actor_and_critic_are_one_unit(engines, tmp_path):
    """Colocated mode saves both engines into one staged folder: a failure writing the Critic
    leaves no checkpoint of that step at all, and the previous one untouched."""
    actor, critic = engines
    run_dir = tmp_path / "run"
    with staged_checkpoint(checkpoint_path(run_dir, 1)) as staging:
        actor.write_checkpoint(staging, {"loop_step": 1})
        critic.write_checkpoint(staging / "critic", {"loop_step": 1})
    with pytest.raises(RuntimeError, match="disk gone"), staged_checkpoint(checkpoint_path(run_dir, 2)) as staging:
        actor.write_checkpoint(staging, {"loop_step": 2})
        raise RuntimeError("disk gone")  # injected fault: the Critic's half never gets written
    found = latest_checkpoint(run_dir)
    assert found == checkpoint_path(run_dir, 1) and sorted(p.name for p in found.parent.iterdir()) == ["step_000001"]
    assert critic.load_checkpoint(found / "critic") == {"loop_step": 1}
    assert actor.load_checkpoint(found) == {"loop_step": 1}


def test_export_copies_only_the_allowlist(engines, tmp_path):
    actor, critic = engines
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    with staged_checkpoint(checkpoint) as staging:
        actor.write_checkpoint(staging, {"prompt": "SECRET-PROMPT"})
        critic.write_checkpoint(staging / "critic", {})
        (staging / "chat_template.jinja").write_text("{{ messages }}")
        (staging / "preprocessor_config.json").write_text("{}")
        (staging / "responses.jsonl").write_text('{"response": "SECRET-RESPONSE"}')
        (staging / "run_state.safetensors").write_bytes(b"bus data")
    names = export_checkpoint(checkpoint, tmp_path / "hf")
    assert set(names) == {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "preprocessor_config.json"} <= set(names)
    assert not {"optimizer.pt", "trainer_state.json", "critic", "responses.jsonl", "run_state.safetensors",
                MARKER} & set(names)
    assert not any("SECRET" in p.read_text(errors="ignore") for p in (tmp_path / "hf").iterdir())
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.vocab_size > 0
    assert "model*.safetensors" in EXPORT_PATTERNS  # the registry later features extend
    with pytest.raises(CheckpointError, match="inside the checkpoint"):
        export_checkpoint(checkpoint, checkpoint / "hf")
    (checkpoint / MARKER).unlink()  # as a save cut short leaves it
    with pytest.raises(CheckpointError, match="is not a complete checkpoint"):
        export_checkpoint(checkpoint, tmp_path / "hf2")


def test_export_never_follows_a_link_out_of_the_checkpoint(engines, tmp_path):
    actor, _ = engines
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    with staged_checkpoint(checkpoint) as staging:
        actor.write_checkpoint(staging, {})
    secret = tmp_path / "id_rsa"
    secret.write_text("SECRET-KEY")
    (checkpoint / "tokenizer.json").unlink()
    (checkpoint / "tokenizer.json").symlink_to(secret)  # someone else's checkpoint, made to leak your key
    with pytest.raises(CheckpointError, match=r"tokenizer.json is a link to .*id_rsa, outside the checkpoint"):
        export_checkpoint(checkpoint, tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    (checkpoint / "tokenizer.json").unlink()  # a link inside the checkpoint is its own file: exported as a file
    (checkpoint / "tokenizer.json").symlink_to(checkpoint / "tokenizer_config.json")
    assert "tokenizer.json" in export_checkpoint(checkpoint, tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").is_symlink()


def test_convert_run_turns_old_checkpoints_into_data_files(engines, tmp_path):
    """An old run: the Actor's checkpoint with a pickled run state, the async Critic's own."""
    actor, critic = engines
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("{}")
    old_state = {"samples_per_group": {3: 4}, "bus": {"capacity": 8, "next_row_id": 1, "rows_per_group": {3: 1},
                                                     "rows": [(0, 3, 2, {"values": torch.ones(2)}, ["train"])]},
                 "prompts": {"position": 4, "unfinished": [], "rolled_back": 0}}
    for folder, engine in ((checkpoint_path(run_dir, 2), actor), (checkpoint_path(run_dir, 2, "critic"), critic)):
        engine.write_checkpoint(folder, {"loop_step": 2})  # the old layout: no marker
    (checkpoint_path(run_dir, 2) / LEGACY_FILE).write_bytes(pickle.dumps(old_state))
    with pytest.raises(CheckpointError, match="convert-run"):
        latest_checkpoint(run_dir)

    assert set(convert_run(run_dir)) == {checkpoint_path(run_dir, 2), checkpoint_path(run_dir, 2, "critic")}
    actor_ckpt = latest_checkpoint(run_dir)
    assert actor_ckpt == checkpoint_path(run_dir, 2) and latest_checkpoint(run_dir, "critic") is not None
    assert not (actor_ckpt / LEGACY_FILE).exists() and (actor_ckpt / STATE_FILE).exists()
    state = load_run_state(actor_ckpt)
    assert state["samples_per_group"] == {3: 4} and torch.equal(state["bus"]["rows"][0][3]["values"], torch.ones(2))
    assert actor.load_checkpoint(actor_ckpt)["loop_step"] == 2  # optimizer loads with weights_only=True
    assert (run_dir / ".rlx-run").exists() and convert_run(run_dir) == []  # nothing left to convert
