"""Observability: metrics lines, metrics.jsonl, TensorBoard, plots."""

from rlx.obs.metrics import MetricsWriter
from rlx.obs.plot import plot_run

__all__ = ["MetricsWriter", "plot_run"]
