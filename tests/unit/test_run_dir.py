"""`--overwrite` deletes only a run directory rlx made, never a path that merely exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlx.config import build_config
from rlx.orchestration.run_dir import RUN_MARKER, RunDirError, prepare_run_dir


def prepare(run_dir: Path | str, overwrite: bool = True) -> Path:
    return prepare_run_dir(build_config({"logging": {"run_dir": str(run_dir)}}), resume=False, overwrite=overwrite)


def test_a_run_directory_rlx_made_is_replaced(tmp_path):
    run_dir = prepare(tmp_path / "run", overwrite=False)
    assert (run_dir / RUN_MARKER).is_file()
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}")
    with pytest.raises(RunDirError, match="--overwrite to replace it"):
        prepare(run_dir, overwrite=False)
    prepare(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == [RUN_MARKER, "config.yaml"]


def test_an_empty_directory_is_reused(tmp_path):
    (tmp_path / "empty").mkdir()
    assert (prepare(tmp_path / "empty") / RUN_MARKER).is_file()


@pytest.mark.parametrize("where, reason", [
    ("mine", "rlx did not create it"),  # someone's folder that happens to be there
    (".", "the working directory"),
    ("..", "the working directory or one of its parents"),
    ("~", "your home directory"),
    ("/", "the filesystem root"),
    ("link", "a symlink"),
])
def test_overwrite_refuses_paths_rlx_did_not_make(tmp_path, monkeypatch, where, reason):
    cwd, home = tmp_path / "work" / "cwd", tmp_path / "home"
    for folder in (cwd, home, tmp_path / "mine", tmp_path / "run"):
        folder.mkdir(parents=True)
        (folder / "precious.txt").write_text("keep me")
    for folder in (cwd, home, tmp_path / "run"):  # even a marker does not make these deletable
        (folder / RUN_MARKER).touch()
    (tmp_path / "link").symlink_to(tmp_path / "run")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    target = {"mine": tmp_path / "mine", "~": home, "link": tmp_path / "link"}.get(where, where)
    with pytest.raises(RunDirError, match=f"--overwrite refuses to delete.*{reason}.*logging.run_dir"):
        prepare(target)
    assert all((f / "precious.txt").read_text() == "keep me" for f in (cwd, home, tmp_path / "mine", tmp_path / "run"))
