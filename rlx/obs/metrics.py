"""Metrics: one JSON line per step in `metrics.jsonl`, a short console line, optional TensorBoard."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

CONSOLE_KEYS = ("reward_mean", "eval_accuracy", "loss", "kl", "entropy", "clip_fraction", "response_length",
                "gen_tokens_per_s", "time_step_s")


def format_line(step: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}"]
    for key in CONSOLE_KEYS:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(f"{key}={value:.4g}")
    return " ".join(parts)


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = False, echo: Callable[[str], None] = print) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.echo = echo
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **metrics}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        self.echo(format_line(step, metrics))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
