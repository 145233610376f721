"""The staleness benchmark's bookkeeping: resumable cells, intervals over seeds, the target verdict."""

from __future__ import annotations

import json
import math

import pytest

from rlx.bench.staleness import cell_dir, format_table, mean_and_half_width, run_staleness_benchmark


def write_run(run_dir, evals, staleness, kl):
    run_dir.mkdir(parents=True)
    records = [{"step": 0, "eval_accuracy": evals[0]},
               {"step": 1, "trained_samples": 64, "staleness_mean": staleness, "behavior_kl": kl},
               {"step": 1, "eval_accuracy": evals[1]}]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return run_dir


def test_the_interval_is_students_t_over_seeds():
    mean, half = mean_and_half_width([0.10, 0.20, 0.30])
    assert mean == pytest.approx(0.20)
    assert half == pytest.approx(4.303 * 0.1 / math.sqrt(3))  # t(0.975, 2 df) * s / sqrt(n)
    assert math.isnan(mean_and_half_width([0.1])[1])


def test_finished_cells_are_read_back_and_only_missing_ones_run(tmp_path):
    write_run(cell_dir(tmp_path, (0, "none", 0)), (0.05, 0.30), 0.0, 0.001)
    ran = []

    def fake_run(config, overwrite, echo):  # stands in for an async run: writes what one would
        ran.append(config.train.max_staleness)
        return write_run(config.run_dir, (0.05, 0.28), 3.1, 0.02)

    records = tmp_path / "records"
    results = run_staleness_benchmark(tmp_path, steps=1, eval_size=10, run=fake_run,
                                      cells=[(0, "none", 0), (4, "decoupled", 0)], results_dir=records)
    assert ran == [4]
    assert sorted(p.name for p in records.iterdir()) == ["s0-none-seed0.json", "s4-decoupled-seed0.json"]
    for run_dir in tmp_path.glob("s*-seed0"):  # a later session has the records, not the runs
        (run_dir / "metrics.jsonl").unlink()
    assert run_staleness_benchmark(tmp_path, steps=1, eval_size=10, run=fake_run, results_dir=records,
                                   cells=[(4, "decoupled", 0)]) == results
    assert ran == [4]
    assert results[(0, "none", 0)]["gain"] == pytest.approx(0.25)
    assert results[(4, "decoupled", 0)] == {"gain": pytest.approx(0.23), "staleness": 3.1, "behavior_kl": 0.02}
    table = format_table(results)
    assert "| 4 | decoupled | 1 | +0.230" in table
    assert "met; on-policy +0.250, staleness 4 decoupled +0.230, gap +0.020" in table


def test_a_gap_past_the_target_is_reported_as_not_met(tmp_path):
    results = {(0, "none", 0): {"gain": 0.25, "staleness": 0.0, "behavior_kl": 0.0},
               (4, "decoupled", 0): {"gain": 0.10, "staleness": 3.5, "behavior_kl": 0.05}}
    assert "not met" in format_table(results)


def test_cells_name_staleness_and_correction_and_take_every_seed_or_the_one_named():
    from rlx.bench.staleness import parse_cells

    assert parse_cells("4:decoupled") == [(4, "decoupled", 0), (4, "decoupled", 1), (4, "decoupled", 2)]
    assert parse_cells("2:tis:1,0:none") == [(2, "tis", 1), (0, "none", 0), (0, "none", 1), (0, "none", 2)]
    for bad in ("4:ppo", "4", "4:tis:x", "4:tis:0:1", "4:tis:7"):
        with pytest.raises(ValueError, match=f"'{bad}' is not <max_staleness>:<correction>"):
            parse_cells(bad)
