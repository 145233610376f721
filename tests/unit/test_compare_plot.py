"""`rlx compare`: runs' metrics.jsonl files into one PNG against trained samples and wall time. The
files are written by hand here: this tests the plotting of files, not training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlx.cli import main
from rlx.errors import UserError
from rlx.obs.plot import plot_compare, samples_seen, wall_times


def write_run(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def colocated_records() -> list[dict]:
    """As colocated mode writes them: totals on every step line, the final evaluation on its own line."""
    steps = [{"step": s, "reward_mean": 0.1 * s, "trained_samples": 32.0, "total_trained_samples": 32.0 * s,
              "wall_time_s": 2.0 * s} for s in range(1, 5)]
    steps[1]["eval_accuracy"] = 0.3
    return [{"step": 0, "eval_accuracy": 0.1}, *steps, {"step": 4, "eval_accuracy": 0.5, "wall_time_s": 8.5}]


def async_records() -> list[dict]:
    """As async mode writes them: per-step counts only, no totals."""
    steps = [{"step": s, "reward_mean": 0.15 * s, "trained_samples": 24.0, "wall_time_s": 1.5 * s,
              "busy_rollout": 0.9} for s in range(1, 4)]
    return [{"step": 0, "eval_accuracy": 0.1}, *steps, {"step": 3, "eval_accuracy": 0.4, "wall_time_s": 5.0}]


def test_samples_come_from_totals_or_the_running_sum_of_per_step_counts():
    assert samples_seen(colocated_records()) == [0.0, 32.0, 64.0, 96.0, 128.0, 128.0]
    assert samples_seen(async_records()) == [0.0, 24.0, 48.0, 72.0, 72.0]
    assert wall_times(async_records()) == [0.0, 1.5, 3.0, 4.5, 5.0]
    assert wall_times([{"step": 2, "eval_accuracy": 0.3}]) == [None]  # no time known: not plotted


def test_two_runs_make_one_png(tmp_path, capsys):
    a = write_run(tmp_path / "grpo", colocated_records())
    b = write_run(tmp_path / "async-s2", async_records())
    out = tmp_path / "compare.png"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_runs_of_the_same_name_are_told_apart_by_their_path(tmp_path):
    a = write_run(tmp_path / "a" / "run", colocated_records())
    b = write_run(tmp_path / "b" / "run", async_records())
    assert plot_compare([a, b], tmp_path / "out.png").stat().st_size > 10_000


def test_a_folder_without_metrics_is_an_error_naming_it(tmp_path, capsys):
    good = write_run(tmp_path / "good", colocated_records())
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    assert main(["compare", str(good), str(empty), "--out", str(tmp_path / "x.png")]) == 2
    assert f"{empty} has no metrics.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="holds no records"):
        plot_compare([empty], tmp_path / "x.png")
