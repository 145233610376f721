"""Colocate vs async (on- and off-policy) on identical work, measured side by side in one run.

Same model, prompts, samples per step, steps, engine and sampling settings in every mode. The
response lengths follow a long tail: the model is a random-init Llama and one character ('a') ends
a response, so lengths are roughly geometric (mean about 40 tokens) with a tail towards the
256-token cap, as in RL on reasoning tasks.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rlx.config import RunConfig, build_config
from rlx.models.tiny import build_tiny, char_tokenizer
from rlx.obs.metrics import read_metrics

MODES = (("colocate", 0), ("async", 0), ("async", 1), ("async", 2))


def bench_config(mode: str, staleness: int, work_dir: Path, model: Path, data: Path, steps: int) -> RunConfig:
    tokenizer = char_tokenizer()
    threads = {"threads": 1, "num_cpus": 1}
    return build_config({
        "model": {"path": str(model)},
        "data": {"source": "jsonl", "path": str(data), "eval_size": 0},
        "rollout": {"n": 8, "prompts_per_step": 8, "max_new_tokens": 256, "max_batch_size": 64,
                    "stop_token_ids": tokenizer.convert_tokens_to_ids(["a"])},
        "reward": {"name": "exact_match", "extract": "none"},
        "algorithm": {"filter_zero_std_groups": False},
        "train": {"mode": mode, "max_staleness": staleness, "steps": steps, "lr": 1e-5, "micro_batch_size": 16,
                  "eval_every": 0},
        "resources": {"num_threads": 2, "rollout": threads, "actor": threads},
        "logging": {"run_dir": str(work_dir / f"{mode}-s{staleness}"), "progress_bar": False},
    })


def summarize(config: RunConfig, wall_s: float) -> dict[str, float | str]:
    """Steady-state throughput: from the end of step 1 to the end of the last step."""
    steps = [r for r in read_metrics(config.run_dir) if "reward_mean" in r]
    samples = config.rollout.n * config.rollout.prompts_per_step
    span = steps[-1]["wall_time_s"] - steps[0]["wall_time_s"]
    row: dict[str, float | str] = {
        "mode": config.train.mode if config.train.mode == "colocate" else f"async, max_staleness={config.train.max_staleness}",
        "samples_per_s": samples * (len(steps) - 1) / span,
        "step_s": span / (len(steps) - 1),
        "response_length": sum(r["response_length"] for r in steps) / len(steps),
        "truncated": sum(r["truncated_fraction"] for r in steps) / len(steps),
        "wall_s": wall_s,
    }
    last = steps[-1]
    if config.train.mode == "colocate":
        busy_total = sum(r["time_step_s"] for r in steps[1:])
        for role in ("rollout", "reward", "advantages", "train"):
            row[f"busy_{role if role != 'train' else 'actor'}"] = sum(r[f"time_{role}_s"] for r in steps[1:]) / busy_total
    else:
        for role in ("rollout", "reward", "advantages", "actor"):
            row[f"busy_{role}"] = last[f"busy_{role}"]
    return row


def run_pipeline_benchmark(work_dir: Path, steps: int = 8, hidden: int = 512, layers: int = 4) -> list[dict]:
    from rlx.orchestration.async_run import run_async
    from rlx.orchestration.colocate import run_colocate

    work_dir.mkdir(parents=True, exist_ok=True)
    model = build_tiny(work_dir / "model", hidden=hidden, layers=layers, heads=8, seed=0)
    data = work_dir / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Write something about {i}:", "label": "x"}) + "\n"
                            for i in range(512)))
    results = []
    for mode, staleness in MODES:
        config = bench_config(mode, staleness, work_dir, model, data, steps)
        run = run_colocate if mode == "colocate" else run_async
        start = time.perf_counter()
        run(config, overwrite=True, echo=lambda _: None)
        results.append(summarize(config, time.perf_counter() - start))
    base = results[0]["samples_per_s"]
    for row in results:
        row["speedup"] = row["samples_per_s"] / base
    # The same colocated work on one thread: how much work there is, in core-seconds per step.
    single = bench_config("colocate", 0, work_dir, model, data, steps)
    single.resources.num_threads = 1
    single.logging.run_dir = str(work_dir / "colocate-one-thread")
    start = time.perf_counter()
    run_colocate(single, overwrite=True, echo=lambda _: None)
    results[0]["one_thread_step_s"] = summarize(single, time.perf_counter() - start)["step_s"]
    return results


def overlap_bound(results: list[dict]) -> str:
    """The most any schedule could gain on these cores: the single-threaded step's work spread
    over every core with no idle time and no overhead."""
    cores, one_thread, colocate = os.cpu_count() or 1, results[0]["one_thread_step_s"], results[0]["step_s"]
    return (f"Bound: colocate takes {one_thread:.2f} s per step on one thread and {colocate:.2f} s on {cores}. "
            f"Spread perfectly over {cores} cores, that work needs at least {one_thread / cores:.2f} s per step, "
            f"so no schedule (async included) can beat colocate by more than "
            f"{cores * colocate / one_thread:.2f}x on this machine.")


def format_table(results: list[dict]) -> str:
    lines = ["| mode | samples/s | speed-up | s/step | busy rollout | busy reward | busy advantages | busy actor |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['samples_per_s']:.1f} | {r['speedup']:.2f}x | {r['step_s']:.2f} | "
                     f"{r['busy_rollout']:.2f} | {r['busy_reward']:.2f} | {r['busy_advantages']:.2f} | "
                     f"{r['busy_actor']:.2f} |")
    lengths = ", ".join(f"{r['mode']}: {r['response_length']:.0f} tokens ({100 * r['truncated']:.0f}% at cap)"
                        for r in results)
    return "\n".join(lines) + f"\n\nMean response length per mode: {lengths}.\n\n{overlap_bound(results)}"
