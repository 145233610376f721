"""Metrics sinks beside metrics.jsonl: TensorBoard and Weights & Biases.

One naming rule for both: a sink receives each metrics.jsonl record under the record's own keys,
nothing renamed or grouped, so a key in docs/metrics.md finds the same series in the JSONL file,
TensorBoard and W&B. TensorBoard takes the numbers as scalars at global step `step`; W&B takes the
whole record (`step` included) as one history row, with every series plotted against `step`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rlx.config import RunConfig


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files under <run_dir>/tensorboard (`tensorboard --logdir <run_dir>/tensorboard`)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run per rlx process (a resumed run starts a new W&B run under the same name). Files go
    to <run_dir>/wandb; console capture is off (rlx prints its own lines). Offline, wandb's crash
    reporting is off too unless WANDB_ERROR_REPORTING says otherwise: with it on, even an offline
    run looks up its endpoint's address (measured with strace)."""

    def __init__(self, run_dir: Path, config: RunConfig) -> None:
        settings = config.logging.wandb
        if settings.mode == "offline":
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # read when wandb starts its service
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project=settings.project, name=settings.name or config.logging.name, dir=str(run_dir),
            config={**config.model_dump(mode="json"), "resolved": config.resolved()},
            settings=wandb.Settings(mode=settings.mode, console="off", silent=True))
        self._run.define_metric("*", step_metric="step")

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(record)

    def close(self) -> None:
        """Finish the run, then stop wandb's service process (`wandb-core`), which outlives runs."""
        try:
            self._run.finish()
        finally:
            self._wandb.teardown()


def open_sinks(run_dir: Path, config: RunConfig) -> list[Sink]:
    """The sinks `config.logging` turns on; if one fails to open, those already open are closed."""
    sinks: list[Sink] = []
    try:
        if config.logging.tensorboard:
            sinks.append(TensorBoardSink(run_dir))
        if config.logging.wandb.enabled:
            sinks.append(WandbSink(run_dir, config))
    except BaseException:
        close_all(sinks)
        raise
    return sinks


def close_all(sinks: list[Sink]) -> None:
    """Close every sink even if one fails; the first failure is raised afterwards."""
    failure: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except BaseException as exc:  # noqa: BLE001 - the others still close
            failure = failure or exc
    if failure is not None:
        raise failure
