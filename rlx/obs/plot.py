"""PNGs of metrics.jsonl: one run's reward and held-out accuracy per step (`plot_run`, written into
the run directory), and several runs side by side against samples and wall time (`plot_compare`,
`rlx compare`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlx.errors import UserError
from rlx.obs.metrics import read_metrics

Record = dict[str, Any]
# (key, label): what every plot shows; the held-out accuracy is drawn with markers (few points)
CURVES = (("reward_mean", "train reward (mean)"), ("eval_accuracy", "held-out greedy accuracy"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def points(records: list[Record], xs: list[float | None], key: str) -> tuple[list[float], list[float]]:
    """(x, value) of the records holding `key`, x from `xs` (parallel to `records`; None: no x)."""
    pairs = [(x, r[key]) for r, x in zip(records, xs) if key in r and x is not None]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _draw(ax, key: str, xs: list[float], ys: list[float], **style: Any) -> None:
    if xs:
        ax.plot(xs, ys, **({"marker": "o"} if key == "eval_accuracy" else {"alpha": 0.7}), **style)


def _save(plt, fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    plt = _pyplot()
    records = read_metrics(run_dir)
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in CURVES:
        _draw(ax, key, *points(records, steps, key), label=label)
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(run_dir.name)
    return _save(plt, fig, out or run_dir / "training.png")


def samples_seen(records: list[Record]) -> list[float]:
    """Trained samples so far at each record: `total_trained_samples` where the line has it (colocated
    mode, kept over resume), else the running sum of `trained_samples` (async mode has no totals)."""
    seen, out = 0.0, []
    for record in records:
        if "total_trained_samples" in record:
            seen = record["total_trained_samples"]
        elif "trained_samples" in record:
            seen += record["trained_samples"]
        out.append(seen)
    return out


def wall_times(records: list[Record]) -> list[float | None]:
    """`wall_time_s` of each record; the initial evaluation (step 0, before any timing) is at 0."""
    return [r.get("wall_time_s", 0.0 if r["step"] == 0 else None) for r in records]


def run_records(run_dir: Path) -> list[Record]:
    """The records of a run directory; a directory without any is an error naming the path."""
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl: give run directories (runs/<logging.name>)")
    records = read_metrics(run_dir)
    if not records:
        raise UserError(f"{run_dir / 'metrics.jsonl'} holds no records yet")
    return records


def plot_compare(run_dirs: list[Path], out: Path) -> Path:
    """Reward and held-out accuracy of several runs, against trained samples (left) and wall time
    (right), one colour per run; the legend names each run by its directory."""
    runs = [(run_dir, run_records(run_dir)) for run_dir in run_dirs]
    names = [run_dir.name for run_dir in run_dirs]
    if len(set(names)) < len(names):  # runs/a/run and runs/b/run: the whole path tells them apart
        names = [str(run_dir) for run_dir in run_dirs]
    plt = _pyplot()
    fig, axes = plt.subplots(len(CURVES), 2, figsize=(11, 7), sharex="col", squeeze=False)
    for i, ((_, records), name) in enumerate(zip(runs, names)):
        for row, (key, _) in enumerate(CURVES):
            for col, xs in enumerate((samples_seen(records), wall_times(records))):
                _draw(axes[row][col], key, *points(records, xs, key), color=f"C{i}", label=name)
    for row, (key, label) in enumerate(CURVES):
        for col, xlabel in enumerate(("trained samples", "wall time (s)")):
            ax = axes[row][col]
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if row == len(CURVES) - 1:
                ax.set_xlabel(xlabel)
            if key == "eval_accuracy":
                ax.set_ylim(0, 1)
    axes[0][0].legend(loc="lower right")
    return _save(plt, fig, out)
