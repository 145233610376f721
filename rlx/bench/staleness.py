"""Off-policy training at a fixed sample budget: SmolLM2 chain_sum in async mode at several
`max_staleness` values, each with several behaviour corrections and seeds.

Every cell (staleness, correction, seed) is one async run in its own folder under the work dir. A
finished cell's result is recorded as JSON in `RESULTS_DIR`, a folder the repository tracks, and
read back instead of run again: the benchmark resumes where it stopped, in a later session or on
another machine (the whole grid takes hours on a CPU). The table gives each gain as the mean over seeds with a 95%
t-interval, the mean staleness the runs actually reached, and the behaviour-to-current KL.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

from rlx.config import load_config
from rlx.obs.metrics import read_metrics

BASE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "chain_sum_smollm2.yaml"
RESULTS_DIR = Path(__file__).resolve().parents[2] / "docs" / "bench-data" / "staleness"
STALENESS = (0, 2, 4)
CORRECTIONS = ("none", "tis", "decoupled")
SEEDS = (0, 1, 2)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
TARGET_GAP = 0.03  # the default correction at staleness 4 within this of the on-policy gain

Cell = tuple[int, str, int]  # (max_staleness, correction, seed)


def parse_cells(text: str | None) -> list[Cell] | None:
    """`--cells 0:none,4:tis:1` -> those (staleness, correction) pairs, each with every seed or with
    the one seed named after a second colon."""
    if not text:
        return None
    cells = []
    for item in text.split(","):
        parts = item.split(":")
        if (len(parts) not in (2, 3) or not parts[0].isdigit() or parts[1] not in CORRECTIONS
                or not all(seed in map(str, SEEDS) for seed in parts[2:])):
            raise ValueError(f"--cells item {item!r} is not <max_staleness>:<correction>[:<seed>] with correction "
                             f"one of {', '.join(CORRECTIONS)} and seed one of {', '.join(map(str, SEEDS))} "
                             "(e.g. 4:decoupled or 4:tis:0)")
        seeds = [int(seed) for seed in parts[2:]] or SEEDS
        cells.extend((int(parts[0]), parts[1], seed) for seed in seeds)
    return cells


def cell_dir(work_dir: Path, cell: Cell) -> Path:
    staleness, correction, seed = cell
    return work_dir / f"s{staleness}-{correction}-seed{seed}"


def cell_overrides(cell: Cell, work_dir: Path, steps: int, eval_size: int) -> list[str]:
    staleness, correction, seed = cell
    return ["train.mode=async", f"train.max_staleness={staleness}", f"algorithm.behavior_correction={correction}",
            f"train.seed={seed}", f"data.seed={seed}", f"data.eval_size={eval_size}", f"train.steps={steps}",
            f"train.eval_every={steps}", "train.time_budget_s=null", "train.checkpoint_every=0",
            f"logging.run_dir={cell_dir(work_dir, cell)}", "logging.progress_bar=false"]


def cell_result(run_dir: Path) -> dict[str, float] | None:
    """The finished run's gain, mean staleness and behaviour KL; None if it did not finish."""
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    evals = [r for r in records if "eval_accuracy" in r]
    steps = [r for r in records if "trained_samples" in r]
    if len(evals) < 2 or not steps:
        return None
    kls = [r["behavior_kl"] for r in steps if "behavior_kl" in r]
    return {"gain": evals[-1]["eval_accuracy"] - evals[0]["eval_accuracy"],
            "staleness": statistics.fmean(r["staleness_mean"] for r in steps),
            "behavior_kl": statistics.fmean(kls) if kls else math.nan}


def mean_and_half_width(values: list[float]) -> tuple[float, float]:
    """The mean and the half width of its 95% t-interval (nan for a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, T_975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def recorded(results_dir: Path, cell: Cell) -> dict[str, float] | None:
    path = results_dir / f"{cell_dir(Path(), cell).name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def record(results_dir: Path, cell: Cell, result: dict[str, float]) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{cell_dir(Path(), cell).name}.json").write_text(json.dumps(result, indent=1) + "\n")


def run_staleness_benchmark(work_dir: Path, steps: int, eval_size: int, run: Callable[..., Path],
                            cells: Iterable[Cell] | None = None,
                            results_dir: Path = RESULTS_DIR) -> dict[Cell, dict[str, float]]:
    """Run every cell of `cells` (default: the whole grid) that has no result yet with `run(config,
    overwrite=True, echo=...)`, the async trainer; return the results of every finished cell."""
    grid = [(s, c, seed) for s in STALENESS for c in CORRECTIONS for seed in SEEDS]
    selected = set(grid if cells is None else cells)
    results = {}
    for cell in sorted(set(grid) | selected, key=lambda cell: (cell[0], CORRECTIONS.index(cell[1]), cell[2])):
        result = recorded(results_dir, cell) or cell_result(cell_dir(work_dir, cell))
        if result is None and cell in selected:
            config = load_config(BASE_CONFIG, cell_overrides(cell, work_dir, steps, eval_size))
            result = cell_result(run(config, overwrite=True, echo=lambda _: None))
        if result is not None:
            record(results_dir, cell, result)
            results[cell] = result
    return results


def format_table(results: dict[Cell, dict[str, float]]) -> str:
    lines = [("| max_staleness | correction | seeds | held-out gain (95% CI) | mean staleness reached "
              "| behaviour→current KL |"), "|---|---|---|---|---|---|"]
    gains: dict[tuple[int, str], float] = {}
    for staleness in sorted({s for s, _, _ in results}):
        for correction in CORRECTIONS:
            cell = [r for (s, c, _), r in results.items() if (s, c) == (staleness, correction)]
            if not cell:
                continue
            gain, half = mean_and_half_width([r["gain"] for r in cell])
            gains[staleness, correction] = gain
            lines.append(f"| {staleness} | {correction} | {len(cell)} | {gain:+.3f} ± {half:.3f} | "
                         f"{statistics.fmean(r['staleness'] for r in cell):.2f} | "
                         f"{statistics.fmean(r['behavior_kl'] for r in cell):.4f} |")
    lines.append("")
    lines.append(target_verdict(gains))
    return "\n".join(lines)


def target_verdict(gains: dict[tuple[int, str], float]) -> str:
    """The default (`auto`) is `decoupled` at staleness 4 and `none` on-policy: compare their means."""
    on_policy, stale = gains.get((0, "none")), gains.get((4, "decoupled"))
    if on_policy is None or stale is None:
        return "Target (default correction at staleness 4 within 0.03 of the on-policy gain): not measured yet."
    gap = on_policy - stale
    verdict = "met" if gap <= TARGET_GAP else "not met"
    return (f"Target (default correction at staleness 4 within {TARGET_GAP} of the on-policy gain): {verdict}; "
            f"on-policy {on_policy:+.3f}, staleness 4 decoupled {stale:+.3f}, gap {gap:+.3f}.")
