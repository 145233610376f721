"""Observability: metrics lines, metrics.jsonl, TensorBoard and W&B sinks, plots, alerts."""

from rlx.obs.alerts import Alerts
from rlx.obs.metrics import MetricsWriter
from rlx.obs.plot import plot_compare, plot_run

__all__ = ["Alerts", "MetricsWriter", "plot_compare", "plot_run"]
