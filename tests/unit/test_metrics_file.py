"""metrics.jsonl survives a write cut short (L12): the records before a torn line are read and the
next record starts on a line of its own; the console line shows a NaN loss instead of hiding it."""

from __future__ import annotations

from rlx.obs.metrics import MetricsWriter, format_line, read_metrics
from rlx.obs.plot import plot_run


def test_a_torn_last_line_is_skipped_and_the_next_record_starts_a_line_of_its_own(tmp_path, caplog):
    writer = MetricsWriter(tmp_path, echo=lambda _: None)
    writer.write(1, {"reward_mean": 0.5})
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 2, "reward_me')  # the disk filled up mid-write
    assert read_metrics(tmp_path) == [{"step": 1, "reward_mean": 0.5}]
    assert "skipped line(s) 2" in caplog.text
    writer.write(3, {"reward_mean": 0.7})  # a resumed run appends
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 3]
    plot_run(tmp_path)  # the end of a run draws its plot from what was read
    assert (tmp_path / "training.png").stat().st_size > 0


def test_the_console_line_shows_a_nan_loss():
    assert format_line(4, {"loss": float("nan"), "reward_mean": 0.25, "kl": True}) == "step 4 reward_mean=0.25 loss=nan"
