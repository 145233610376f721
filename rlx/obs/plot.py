"""A PNG of reward and held-out accuracy per step, written into the run directory."""

from __future__ import annotations

from pathlib import Path

from rlx.obs.metrics import read_metrics


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out = out or run_dir / "training.png"
    fig, ax = plt.subplots(figsize=(7, 4))
    rewards = [(r["step"], r["reward_mean"]) for r in records if "reward_mean" in r]
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    if rewards:
        ax.plot(*zip(*rewards), label="train reward (mean)", alpha=0.7)
    if evals:
        ax.plot(*zip(*evals), marker="o", label="held-out greedy accuracy")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
