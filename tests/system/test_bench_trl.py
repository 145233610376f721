"""`rlx bench trl`: TRL's GRPOTrainer and rlx train side by side on identical settings (a tiny model
here, so both finish in seconds; the benchmark itself uses SmolLM2-135M)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from rlx.bench.trl import Settings, format_table, run_system, run_trl_benchmark, train_prompts

pytest.importorskip("trl")  # the `bench` extra, which `make install` installs


def test_both_systems_train_the_same_budget_and_are_scored_alike(tiny_path, tmp_path):
    settings = Settings(model=str(tiny_path), steps=2, train_size=64, eval_size=8, max_new_tokens=8,
                        prompts_per_step=2, n=4, micro_batch_size=8)
    result = run_trl_benchmark(tmp_path, settings, ("trl", "rlx"))
    assert set(result["rows"]) == {"trl", "rlx"}
    for row in result["rows"].values():
        assert row["steps"] == 2 and len(row["step_s"]) == 2 and len(row["reward"]) == 2
        assert 0 < row["startup_s"] < 300 and row["train_s"] > 0
        assert (Path(row["model_dir"]) / "config.json").exists()
        assert 0.0 <= row["after"] <= 1.0
    table = format_table(result)
    assert "| trl |" in table and "| rlx |" in table and "| 1.00x |" in table
    assert "2 steps of 2 prompts x 4 samples (16 samples)" in table


def test_trl_is_given_the_rows_rlx_takes_in_order():
    settings = Settings(steps=3, train_size=50)
    rows = train_prompts(settings)
    assert len(rows) == 3 * settings.prompts_per_step
    assert len({row.prompt for row in rows}) == len(rows)  # distinct draws of the stream, not one row repeated
    assert rows == train_prompts(settings)  # deterministic: the same prompts for every system


def test_the_table_reports_rates_relative_to_trl():
    def row(train_s: float, after: float) -> dict:
        return {"steps": 10, "train_s": train_s, "step_s": [train_s / 10] * 10, "startup_s": 5.0, "after": after}

    result = {"settings": {**asdict(Settings()), "steps": 10}, "before": 0.1,
              "rows": {"trl": row(200.0, 0.3), "rlx": row(50.0, 0.35)}}
    table = format_table(result)
    # 10 steps x 32 samples: 1.60 samples/s for TRL, 6.40 for rlx, 4x
    assert "| trl | 1.60 | 1.00x | 20.00 s | 5.0 s | 0.100 → 0.300 | **+0.200** |" in table
    assert "| rlx | 6.40 | 4.00x | 5.00 s | 5.0 s | 0.100 → 0.350 | **+0.250** |" in table
    result["rows"]["rlx-vllm"] = {"error": "exit status 1, see log.txt"}
    assert "| rlx-vllm | failed: exit status 1, see log.txt |" in format_table(result)


def test_a_system_that_fails_is_reported_and_the_others_still_run(tmp_path):
    settings = Settings(model=str(tmp_path / "no-such-model"), steps=1)
    assert "error" in run_system(settings, "rlx", tmp_path)
    assert "model" in (tmp_path / "rlx" / "log.txt").read_text()  # the child's own error, kept for the user
