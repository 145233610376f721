"""Colocated mode: generate a batch, score it, compute advantages, train, sync weights, repeat.

Everything runs in one process on one pool of resources; this is the baseline every other mode is
measured against.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import ray
from tqdm import tqdm

from rlx.bus import LocalBus
from rlx.checkpoints import staged_checkpoint
from rlx.config import RunConfig
from rlx.obs import Alerts, MetricsWriter, plot_run
from rlx.obs.timeline import SPANS, run_folder
from rlx.orchestration.builder import Workers, build_components, build_workers
from rlx.orchestration.cluster import stop_ray
from rlx.orchestration.evaluation import evaluate
from rlx.orchestration.plan import bus_schema
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


def score_new_samples(workers: Workers, timer: PhaseTimer) -> None:
    """Everything between generation and training, in the role plan's dataflow order."""
    order = workers.plan.phase_order
    for task in order[: order.index("train")]:
        with timer(task):
            workers.by_task[task].drain()


def generate_step(workers: Workers, config: RunConfig, timer: PhaseTimer) -> tuple[int, int]:
    """Generate and score one step's groups; with dynamic sampling, replace the groups dropped for
    equal rewards until the step has `prompts_per_step` useful ones or hits the cap. Returns the
    groups and the rows made (`n` per group, more where an agent app's episode made several samples)."""
    wanted, algorithm = config.rollout.prompts_per_step, config.algorithm
    cap = int(wanted * algorithm.max_groups_per_step) if algorithm.dynamic_sampling else wanted
    made, rows, dropped_before = 0, 0, workers.advantages.dropped_groups
    while made < cap:
        count = min(wanted - (made - (workers.advantages.dropped_groups - dropped_before)), cap - made)
        if count <= 0:
            break
        with timer("rollout"):
            rows += workers.rollout.generate(count)
        made += count
        score_new_samples(workers, timer)
    return made, rows


def train_one_step(workers: Workers, config: RunConfig) -> dict[str, float]:
    """Generate one step's groups, then score, advantage, (reference) and train them, in order."""
    timer = PhaseTimer()
    groups, rows = generate_step(workers, config, timer)
    with timer("train"):
        metrics = workers.actor.train_step(rows)
    del metrics["finished_at"]  # the async driver's clock; this loop times its steps itself
    order = workers.plan.phase_order
    for task in order[order.index("train") + 1 :]:  # the Critic's training, once returns are known
        with timer(task):
            workers.by_task[task].drain()
    if workers.critic is not None:
        metrics.update(workers.critic.reports.drain()[-1])
    metrics.update(timer.metrics(), time_step_s=sum(timer.seconds.values()), groups_sampled=float(groups))
    metrics["gen_tokens_per_s"] = metrics["response_length"] * rows / max(timer.seconds["rollout"], 1e-9)
    metrics["train_tokens_per_s"] = metrics["train_tokens"] / max(timer.seconds["train"], 1e-9)
    return metrics


def run_colocate(config: RunConfig, resume: bool = False, overwrite: bool = False,
                 echo: Callable[[str], None] = print) -> Path:
    alerts = Alerts(config.logging.alerts, config.logging.name)
    try:
        return train_colocated(config, resume, overwrite, echo, alerts)
    except BaseException as exc:
        alerts.notify("failure", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        SPANS.close()  # opened once the run directory exists


def train_colocated(config: RunConfig, resume: bool, overwrite: bool, echo: Callable[[str], None],
                    alerts: Alerts) -> Path:
    run_dir = prepare_run_dir(config, resume, overwrite)
    SPANS.open(run_folder(run_dir), "colocated")
    SPANS.record_launch()
    started = time.perf_counter()
    ray_was_running = ray.is_initialized()
    c = build_components(config)
    # Colocated: generation starts a step's groups only after the previous step trained (staleness 0),
    # and weights are copied into the generation engine right after each optimizer step.
    workers = build_workers(c, LocalBus(check_schema=bus_schema(config)), sync_weights=lambda: None,
                            publish=c.sync_weights, max_staleness=0)
    step, totals = 0, Counter()

    def run_eval() -> dict[str, float]:
        with SPANS.span("evaluate", "driver"):
            return evaluate(c.rollout, c.reward, c.eval_rows, c.encode, c.sampling(seed=0, greedy=True))

    if resume:
        checkpoint = latest_checkpoint(run_dir, resuming=True)
        state = c.actor.load(checkpoint)
        if c.critic is not None:
            c.critic.load(checkpoint / "critic")
        step, totals = state["loop_step"], Counter(state["totals"])
        c.prompts.stream.position = state["data_position"]
        c.sync_weights()
        echo(f"resumed from {checkpoint} at step {step} (data position {c.prompts.stream.position})")
    writer = MetricsWriter.for_run(run_dir, config,
                                   echo=tqdm.write if config.logging.progress_bar else echo)

    def save() -> None:
        state = {"loop_step": step, "data_position": c.prompts.stream.position, "totals": dict(totals)}
        with (SPANS.span("checkpoint", "driver", step=step),
              staged_checkpoint(checkpoint_path(run_dir, step)) as staging):  # one unit: complete or absent
            c.actor.write(staging, state)
            if c.critic is not None:  # stateful too: the value model and its optimizer
                c.critic.write(staging / "critic", state)

    if not resume:
        writer.write(0, run_eval())
    eval_every, ckpt_every = config.train.eval_every, config.train.checkpoint_every
    budget = config.train.time_budget_s
    bar = tqdm(total=config.train.steps, initial=step, disable=not config.logging.progress_bar, desc="train")
    try:
        while step < config.train.steps:
            if budget is not None and time.perf_counter() - started > budget:
                echo(f"time budget of {budget:.0f}s reached after {step} steps")
                break
            metrics = train_one_step(workers, config)
            totals.update({k.removeprefix("filtered_"): int(v) for k, v in metrics.items() if k.startswith("filtered_")},
                          prompts=int(metrics["groups_sampled"]),
                          trained_samples=int(metrics["trained_samples"]))
            step += 1
            if eval_every and step % eval_every == 0 and step < config.train.steps:
                metrics.update(run_eval())
            metrics.update({f"total_{k}": float(v) for k, v in totals.items()},
                           wall_time_s=time.perf_counter() - started)
            writer.write(step, metrics)
            bar.update(1)
            if ckpt_every and step % ckpt_every == 0:
                save()
        final = run_eval()
        final["wall_time_s"] = time.perf_counter() - started
        writer.write(step, final)
        save()
        alerts.notify("finished", f"{step} steps in {final['wall_time_s']:.0f}s; held-out accuracy "
                      f"{final.get('eval_accuracy', float('nan')):.3f}")
    finally:
        bar.close()
        writer.close()
        workers.stop()
        c.close()
        if not ray_was_running:
            stop_ray()  # the local cluster the trainers' rank groups started, if any
    plot_run(run_dir)
    return run_dir
