"""Algorithms side by side: the same SmolLM2 chain_sum run (same prompts, samples, steps and
budget) for each algorithm, reporting the held-out accuracy gain and the wall time."""

from __future__ import annotations

from pathlib import Path

from rlx.config import load_config
from rlx.obs.metrics import read_metrics
from rlx.orchestration.colocate import run_colocate

BASE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "chain_sum_smollm2.yaml"

# Each algorithm's own settings on top of the shared example config (GRPO with clip-higher there).
# A loss of another type replaces the whole `algorithm.loss` section, so no clipped-loss knob of the
# example carries over into it.
ALGORITHMS: dict[str, list[str]] = {
    "GRPO": ["algorithm.loss.clip_high=0.2"],
    "DAPO": ["algorithm.loss.clip_high=0.28", "algorithm.dynamic_sampling=true", "reward.overlong_buffer=8",
             "reward.overlong_penalty=0.5"],
    "GSPO": ["algorithm.loss={type: gspo}", "algorithm.aggregation=seq-mean-token-mean"],
    "SAPO": ["algorithm.loss={type: sapo}"],
    "PPO": ["algorithm.advantage=gae", "algorithm.lam=0.95", "critic.lr=5e-5"],
}


def result_of(run_dir: Path) -> dict[str, float]:
    records = read_metrics(run_dir)
    evals = [r for r in records if "eval_accuracy" in r]
    trained = [r for r in records if "trained_samples" in r]
    return {
        "initial": evals[0]["eval_accuracy"], "final": evals[-1]["eval_accuracy"],
        "gain": evals[-1]["eval_accuracy"] - evals[0]["eval_accuracy"],
        "reward_first": trained[0]["reward_mean"], "reward_last": trained[-1]["reward_mean"],
        "wall_s": evals[-1]["wall_time_s"], "steps": float(len(trained)),
    }


def run_algorithm(name: str, work_dir: Path, steps: int) -> dict[str, float]:
    overrides = ALGORITHMS[name] + [f"train.steps={steps}", f"train.eval_every={steps}", "train.time_budget_s=null",
                                    "train.checkpoint_every=0", f"logging.run_dir={work_dir / name.lower()}",
                                    "logging.progress_bar=false"]
    return result_of(run_colocate(load_config(BASE_CONFIG, overrides), overwrite=True, echo=lambda _: None))


def run_algorithms_benchmark(work_dir: Path, steps: int, only: list[str] | None = None) -> dict[str, dict]:
    """Run every algorithm, or just `only` (the table keeps the others' earlier runs in `work_dir`)."""
    unknown = set(only or []) - set(ALGORITHMS)
    if unknown:
        raise ValueError(f"unknown algorithms {sorted(unknown)}; choose from {list(ALGORITHMS)}")
    results = {}
    for name in ALGORITHMS:
        if only is None or name in only:
            results[name] = run_algorithm(name, work_dir, steps)
        elif (work_dir / name.lower() / "metrics.jsonl").exists():
            results[name] = result_of(work_dir / name.lower())
    return results


def format_table(results: dict[str, dict]) -> str:
    lines = [("| algorithm | settings | held-out accuracy before → after | gain | train reward first → last step "
             "| wall time |"), "|---|---|---|---|---|---|"]
    for name, r in results.items():
        settings = ", ".join(f"`{o}`" for o in ALGORITHMS[name])
        lines.append(f"| {name} | {settings} | {r['initial']:.3f} → {r['final']:.3f} | **{r['gain']:+.3f}** | "
                     f"{r['reward_first']:.3f} → {r['reward_last']:.3f} | {r['wall_s']:.0f} s |")
    return "\n".join(lines)
