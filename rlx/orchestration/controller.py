"""Async mode: every role is its own Ray Serve deployment; they meet on the bus.

The Controller starts a Ray cluster (loopback by default), the bus and the weight store, deploys
one service per role, and then only watches: it collects the Actor's step metrics and every role's
busy fraction, evaluates on the held-out split, and shuts everything down on success, error or
Ctrl-C.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import ray
from ray import serve

from rlx.bus.ray_bus import Bus
from rlx.config import ConfigError, RunConfig
from rlx.data import load_splits
from rlx.obs import MetricsWriter, plot_run
from rlx.orchestration.builder import (
    build_reward_role,
    build_rollout,
    model_path,
    prepare_process,
    prompt_encoder,
    sampling_params,
)
from rlx.orchestration.cluster import start_ray, stop_ray
from rlx.orchestration.evaluation import evaluate
from rlx.orchestration.run_dir import checkpoint_path, prepare_run_dir
from rlx.orchestration.services import RoleService, uses_actor_fwd
from rlx.weights.store import WeightStore

POLL_S = 2.0  # status round trips to every service cost CPU the roles need


class RoleFailed(RuntimeError):
    """A role's worker loop died; the message names the role and the error."""


def role_names(config: RunConfig) -> list[str]:
    """The roles this config needs, in start order (the Actor first: it publishes version 0)."""
    roles = ["actor", "genrm" if config.reward.name == "genrm" else "reward", "advantages"]
    if config.algorithm.kl_coef > 0:
        roles.append("reference")
    if config.uses_critic:
        roles.append("critic")
    if config.uses_teacher:
        roles.append("teacher")
    if uses_actor_fwd(config):
        roles.append("actor_fwd")
    return roles + ["rollout"]


class Controller:
    def __init__(self, config: RunConfig, echo: Callable[[str], None] = print) -> None:
        self.config, self.echo = config, echo
        self.handles: dict[str, Any] = {}
        self.started_ray = False

    def deploy(self) -> None:
        cfg = self.config
        self.started_ray = not ray.is_initialized()
        start_ray(cfg.resources.ray_num_cpus, cfg.resources.ray_address)
        serve.start(proxy_location="Disabled")  # roles talk through handles and the bus, not HTTP
        self.bus = Bus.create(capacity=max(1024, 4 * cfg.rollout.prompts_per_step * cfg.rollout.n
                                           * (cfg.train.max_staleness + 2)))
        self.weights = WeightStore.create()
        targets = []
        for role in role_names(cfg):
            res = getattr(cfg.resources, role)
            deployment = serve.deployment(
                RoleService, name=f"rlx-{role}", num_replicas=1,
                ray_actor_options={"num_cpus": res.num_cpus, "num_gpus": res.num_gpus},
                health_check_period_s=2, health_check_timeout_s=60, max_ongoing_requests=8,
            )
            app = deployment.bind(role, cfg.model_dump(mode="json"), self.bus, self.weights)
            targets.append(serve.RunTarget(app, name=f"rlx-{role}", route_prefix=None))
        # one application per role (its own fault domain), all deployed in parallel
        self.handles = dict(zip(role_names(cfg), serve.run_many(targets)))

    def call(self, role: str, method: str, *args: Any) -> Any:
        return getattr(self.handles[role], method).remote(*args).result(timeout_s=600)

    def statuses(self) -> dict[str, dict[str, Any]]:
        out = {role: self.call(role, "status") for role in self.handles}
        for role, status in out.items():
            if status["error"]:
                raise RoleFailed(f"role {role!r} failed: {status['error']}")
        return out

    def shutdown(self) -> None:
        for role in reversed(list(self.handles)):
            try:
                self.call(role, "stop")
            except Exception as exc:  # a dead replica cannot stop; shutting Serve down removes it anyway
                self.echo(f"stopping {role}: {type(exc).__name__}: {exc}")
        if ray.is_initialized():
            serve.shutdown()
        if self.started_ray:
            stop_ray()


class DriverEvaluator:
    """Greedy held-out evaluation in the driver, on the latest published weights."""

    def __init__(self, config: RunConfig, weights: WeightStore) -> None:
        self.config, self.weights = config, weights
        self.rows = load_splits(config.data)[1]
        self.rollout = build_rollout(config, model_path(config))
        self.reward = build_reward_role(config)
        self.encode = prompt_encoder(config, self.rollout.tokenizer)

    def __call__(self) -> dict[str, float]:
        self.weights.pull(self.rollout.engine.weight_version, self.rollout.load_weights)
        metrics = evaluate(self.rollout, self.reward, self.rows, self.encode,
                           sampling_params(self.config, seed=0, greedy=True))
        return {**metrics, "eval_weight_version": float(self.rollout.engine.weight_version)}


def run_async(config: RunConfig, resume: bool = False, overwrite: bool = False,
              echo: Callable[[str], None] = print) -> Path:
    if resume:
        raise ConfigError("--resume works in colocate mode only for now: async resume needs the bus state "
                          "in checkpoints; run with train.mode=colocate or start a new run")
    run_dir = prepare_run_dir(config, resume, overwrite)
    load_splits(config.data)  # bad data or a reward that cannot load stop the run before any service starts
    build_reward_role(config)
    prepare_process(config)
    started = time.perf_counter()
    controller = Controller(config, echo)
    writer = MetricsWriter(run_dir, tensorboard=config.logging.tensorboard, echo=echo)
    try:
        controller.deploy()
        evaluator = DriverEvaluator(config, controller.weights)
        writer.write(0, evaluator())
        for role in controller.handles:
            controller.call(role, "start")
        step, critic_steps = 0, []
        budget = config.train.time_budget_s
        while step < config.train.steps:
            time.sleep(POLL_S)
            statuses = controller.statuses()
            busy = {f"busy_{r}": s["busy_fraction"] for r, s in statuses.items()}
            critic_steps.extend(statuses.get("critic", {}).get("steps", []))
            for metrics in statuses["actor"]["steps"]:
                step += 1
                metrics.update(critic_steps.pop(0) if critic_steps else {})
                metrics.update(busy, wall_time_s=time.perf_counter() - started)
                if config.train.eval_every and step % config.train.eval_every == 0 and step < config.train.steps:
                    metrics.update(evaluator())
                writer.write(step, metrics)
            if budget is not None and time.perf_counter() - started > budget:
                echo(f"time budget of {budget:.0f}s reached after {step} steps")
                break
        controller.call("rollout", "stop")
        controller.call("actor", "call", "save_checkpoint", str(checkpoint_path(run_dir, step)),
                        {"loop_step": step, "data_position": None, "totals": {}})
        final = evaluator()
        final["wall_time_s"] = time.perf_counter() - started
        writer.write(step, final)
    finally:
        writer.close()
        controller.shutdown()
    plot_run(run_dir)
    return run_dir
