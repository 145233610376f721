"""Metrics: one JSON line per step in `metrics.jsonl`, a short console line, optional sinks
(TensorBoard, W&B: `rlx.obs.sinks`). docs/metrics.md explains every key."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlx.obs.sinks import Sink, close_all, open_sinks

if TYPE_CHECKING:
    from rlx.config import RunConfig

CONSOLE_KEYS = ("reward_mean", "eval_accuracy", "loss", "kl", "entropy", "clip_fraction", "response_length",
                "gen_tokens_per_s", "time_step_s")


def format_line(step: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}"]
    for key in CONSOLE_KEYS:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # nan and inf shown: they are news
            parts.append(f"{key}={value:.4g}" if math.isfinite(value) else f"{key}={value}")
    return " ".join(parts)


class MetricsWriter:
    """Appends each step's record to metrics.jsonl and hands the same record to every sink."""

    def __init__(self, run_dir: Path, sinks: Sequence[Sink] = (), echo: Callable[[str], None] = print) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.echo = echo
        self.sinks = list(sinks)

    @classmethod
    def for_run(cls, run_dir: Path, config: RunConfig, echo: Callable[[str], None] = print) -> MetricsWriter:
        """With the sinks `config.logging` turns on (TensorBoard, W&B)."""
        return cls(run_dir, open_sinks(run_dir, config), echo)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **metrics}
        with self.path.open("a+b") as handle:
            if handle.tell() and (handle.seek(-1, 2), handle.read(1))[1] != b"\n":  # a line torn by a crash
                handle.write(b"\n")  # stays a line of its own, not the start of this record's
            handle.write((json.dumps(record) + "\n").encode())
        for sink in self.sinks:
            sink.write(record)
        self.echo(format_line(step, metrics))

    def close(self) -> None:
        close_all(self.sinks)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of metrics.jsonl, in order. A line that is not a whole record (a write cut short by
    a full disk or a kill) is skipped with a warning, so a plot at the end of a run still draws."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records, torn = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            torn.append(number)
    if torn:
        logging.getLogger(__name__).warning("%s: skipped line(s) %s, not whole records (a write cut short?)",
                                            path, ", ".join(map(str, torn)))
    return records
