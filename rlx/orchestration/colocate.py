"""Colocated mode: generate a batch, score it, compute advantages, train, sync weights, repeat.

Everything runs in one process on one pool of resources; this is the baseline every other mode is
measured against.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from rlx.config import RunConfig
from rlx.obs import MetricsWriter, plot_run
from rlx.orchestration.builder import Components, build_components
from rlx.orchestration.evaluation import evaluate
from rlx.orchestration.run_dir import checkpoint_path, latest_checkpoint, prepare_run_dir


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time_{k}_s": v for k, v in self.seconds.items()}


def train_one_step(c: Components, step: int, totals: Counter) -> dict[str, float]:
    cfg, timer = c.config, PhaseTimer()
    groups = [(index, row, c.encode(row)) for index, row in c.train_stream.take(cfg.rollout.prompts_per_step)]
    with timer("rollout"):
        samples = list(c.rollout.generate(groups, cfg.rollout.n, c.sampling(seed=cfg.train.seed * 100_003 + step)))
    with timer("reward"):
        c.reward.score(samples)
    with timer("advantages"):
        result = c.advantages.compute(samples)
    metrics: dict[str, float] = {}
    if result.kept:
        ref_logprobs = None
        if c.reference is not None:
            with timer("reference"):
                ref_logprobs = c.reference.logprobs(result.kept)
        with timer("train"):
            metrics.update(c.actor.train(result.kept, ref_logprobs))
        with timer("sync"):
            c.sync_weights()
    trained_groups = len({s.group_id for s in result.kept})
    totals.update(prompts=len(groups), samples=len(samples), trained_samples=len(result.kept),
                  trained_groups=trained_groups, filtered_groups=len(groups) - trained_groups,
                  reward_failed=result.filtered["reward_failed"])
    lengths = [len(s.response_ids) for s in samples]
    rewards = [s.reward for s in samples if s.reward_error is None]
    metrics.update(timer.metrics())
    metrics.update(
        reward_mean=sum(rewards) / max(1, len(rewards)),
        reward_failed=float(result.filtered["reward_failed"]),
        filtered_zero_std=float(result.filtered["zero_std_group"]),
        response_length=sum(lengths) / len(lengths),
        truncated_fraction=sum(s.finish_reason == "length" for s in samples) / len(samples),
        gen_tokens_per_s=sum(lengths) / max(timer.seconds["rollout"], 1e-9),
        weight_version=float(c.actor.version),
        time_step_s=sum(timer.seconds.values()),
    )
    if "train" in timer.seconds:
        metrics["train_tokens_per_s"] = metrics["train_tokens"] / max(timer.seconds["train"], 1e-9)
    return metrics


def run_colocate(config: RunConfig, resume: bool = False, overwrite: bool = False,
                 echo: Callable[[str], None] = print) -> Path:
    run_dir = prepare_run_dir(config, resume, overwrite)
    started = time.perf_counter()
    c = build_components(config)
    step, totals = 0, Counter()
    if resume:
        checkpoint = latest_checkpoint(run_dir)
        state = c.actor.engine.load_checkpoint(checkpoint)
        step, totals = state["loop_step"], Counter(state["totals"])
        c.train_stream.position = state["data_position"]
        c.sync_weights()
        echo(f"resumed from {checkpoint} at step {step} (data position {c.train_stream.position})")
    writer = MetricsWriter(run_dir, tensorboard=config.logging.tensorboard,
                           echo=tqdm.write if config.logging.progress_bar else echo)

    def save() -> None:
        state = {"loop_step": step, "data_position": c.train_stream.position, "totals": dict(totals)}
        c.actor.engine.save_checkpoint(checkpoint_path(run_dir, step), state)

    if not resume:
        writer.write(0, evaluate(c))
    eval_every, ckpt_every = config.train.eval_every, config.train.checkpoint_every
    budget = config.train.time_budget_s
    bar = tqdm(total=config.train.steps, initial=step, disable=not config.logging.progress_bar, desc="train")
    try:
        while step < config.train.steps:
            if budget is not None and time.perf_counter() - started > budget:
                echo(f"time budget of {budget:.0f}s reached after {step} steps")
                break
            metrics = train_one_step(c, step, totals)
            step += 1
            if eval_every and step % eval_every == 0 and step < config.train.steps:
                metrics.update(evaluate(c))
            metrics.update({f"total_{k}": float(v) for k, v in totals.items()},
                           wall_time_s=time.perf_counter() - started)
            writer.write(step, metrics)
            bar.update(1)
            if ckpt_every and step % ckpt_every == 0:
                save()
        final = evaluate(c)
        final["wall_time_s"] = time.perf_counter() - started
        writer.write(step, final)
        save()
    finally:
        bar.close()
        writer.close()
    plot_run(run_dir)
    return run_dir
