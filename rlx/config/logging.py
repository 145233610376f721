"""The `logging` section: the run's name and directory, and the metrics sinks and alerts it feeds."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator

from rlx.config.base import Section


def _needs_package(enabled: bool, module: str, field: str) -> bool:
    """A metrics sink turned on without its package fails when the config is read, not mid-run."""
    if enabled and importlib.util.find_spec(module) is None:
        raise ValueError(f"{field}=true needs the {module} package: pip install 'rlx[logging]' "
                         f"(or pip install {module})")
    return enabled


class WandbConfig(Section):
    """Weights & Biases: each metrics.jsonl line becomes one W&B history row (same keys, x-axis `step`)
    and the resolved config the run's config. Offline by default: files under <run_dir>/wandb, sent
    later with `wandb sync`; online needs `wandb login` or WANDB_API_KEY."""

    enabled: bool = False
    project: str = "rlx"
    name: str | None = Field(None, description="W&B run name; default logging.name")
    mode: Literal["offline", "online"] = "offline"

    @field_validator("enabled")
    @classmethod
    def _installed(cls, enabled: bool) -> bool:
        return _needs_package(enabled, "wandb", "logging.wandb.enabled")


class LoggingConfig(Section):
    name: str = "run"
    run_dir: str | None = Field(None, description="default runs/<name>")
    progress_bar: bool = True
    tensorboard: bool = Field(False, description="the metrics.jsonl keys as scalars under <run_dir>/tensorboard")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    alerts: list[str] = Field(default_factory=list, description="Apprise URLs notified on failure, recovery "
                              "and finish (e.g. json://127.0.0.1:8000/hook, mailto://, slack://)")

    @field_validator("tensorboard")
    @classmethod
    def _installed(cls, enabled: bool) -> bool:
        return _needs_package(enabled, "tensorboard", "logging.tensorboard")
