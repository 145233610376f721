"""Async mode: every role is its own Ray Serve deployment; they meet on the bus.

The Controller starts a Ray cluster (loopback by default), the bus and the weight store, deploys
one service per role, and then only watches: it collects the Actor's step metrics and every role's
busy fraction, evaluates on the held-out split, and shuts everything down on success, error or
Ctrl-C.
"""

from __future__ import annotations

import json
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
    prompt_source,
    sampling_params,
)
from rlx.orchestration.cluster import start_ray, stop_ray
from rlx.orchestration.evaluation import evaluate
from rlx.orchestration.health import STATEFUL_ROLES, HealthManager, RoleFailed
from rlx.orchestration.prompt_source import PromptSourceClient, RemotePromptSource
from rlx.orchestration.run_dir import checkpoint_path, prepare_run_dir
from rlx.orchestration.services import RoleService, Shared, uses_actor_fwd
from rlx.weights.store import WeightStore

POLL_S = 2.0  # status round trips to every service cost CPU the roles need


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

    def start_substrate(self) -> None:
        """Ray, Serve, and what every role shares: the bus, the weight store, the prompt source."""
        cfg = self.config
        self.started_ray = not ray.is_initialized()
        start_ray(cfg.resources.ray_num_cpus, cfg.resources.ray_address)
        serve.start(proxy_location="Disabled")  # roles talk through handles and the bus, not HTTP
        self.bus = Bus.create(capacity=max(1024, 4 * cfg.rollout.prompts_per_step * cfg.rollout.n
                                           * (cfg.train.max_staleness + 2)))
        self.weights = WeightStore.create()
        source = prompt_source(cfg, load_splits(cfg.data)[0])
        self.prompts = PromptSourceClient(RemotePromptSource.remote(source.stream, source.gate))
        self.shared = Shared(self.bus, self.weights, self.prompts)

    def deploy(self) -> None:
        """One Serve application per role (its own fault domain), deployed in parallel; each role
        starts working as soon as its replica is up."""
        cfg, targets = self.config, []
        for role in role_names(cfg):
            res = getattr(cfg.resources, role)
            deployment = serve.deployment(
                RoleService, name=f"rlx-{role}", num_replicas=1,
                ray_actor_options={"num_cpus": res.num_cpus, "num_gpus": res.num_gpus},
                health_check_period_s=2, health_check_timeout_s=60, max_ongoing_requests=8,
            )
            app = deployment.bind(role, cfg.model_dump(mode="json"), self.shared)
            targets.append(serve.RunTarget(app, name=f"rlx-{role}", route_prefix=None))
        self.handles = dict(zip(role_names(cfg), serve.run_many(targets)))

    def call(self, role: str, method: str, *args: Any) -> Any:
        return getattr(self.handles[role], method).remote(*args).result(timeout_s=600)

    def statuses(self) -> dict[str, dict[str, Any]]:
        """Every role's status; a stateless role being replaced right now is left out this round."""
        out = {}
        for role in self.handles:
            try:
                out[role] = self.call(role, "status")
            except Exception as exc:  # a replica died mid-call; Serve is replacing it
                if role in STATEFUL_ROLES:
                    raise RoleFailed(f"role {role!r} is unreachable: {type(exc).__name__}: {exc}") from exc
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


def check_faults(config: RunConfig) -> None:
    roles = role_names(config)
    for fault in config.faults:
        if fault.role not in roles:
            raise ConfigError(f"faults: role {fault.role!r} is not part of this run; its roles are {', '.join(roles)}")


def run_async(config: RunConfig, resume: bool = False, overwrite: bool = False,
              echo: Callable[[str], None] = print) -> Path:
    if resume:
        raise ConfigError("--resume works in colocate mode only for now: async resume needs the bus state "
                          "in checkpoints; run with train.mode=colocate or start a new run")
    check_faults(config)
    run_dir = prepare_run_dir(config, resume, overwrite)
    load_splits(config.data)  # bad data or a reward that cannot load stop the run before any service starts
    build_reward_role(config)
    prepare_process(config)
    started = time.perf_counter()
    controller = Controller(config, echo)
    writer = MetricsWriter(run_dir, tensorboard=config.logging.tensorboard, echo=echo)
    t = config.train
    try:
        controller.start_substrate()
        evaluator = DriverEvaluator(config, controller.weights)
        writer.write(0, evaluator())  # the initial weights, before any role competes for the CPU
        controller.deploy()
        health = HealthManager(controller.bus, controller.prompts, config.rollout.n, t.max_restarts_per_role,
                               t.max_restarts)
        pending_faults = list(config.faults)
        step, critic_steps = 0, []
        while step < t.steps:
            time.sleep(POLL_S)
            statuses = controller.statuses()
            for recovery in health.observe(statuses):
                echo(f"recovered {recovery.role}: replica {recovery.old_replica} -> {recovery.new_replica}, "
                     f"{recovery.rows_released} rows released, {recovery.groups_requeued} groups requeued")
            busy = {f"busy_{r}": s["busy_fraction"] for r, s in statuses.items()}
            critic_steps.extend(statuses.get("critic", {}).get("steps", []))
            for metrics in statuses.get("actor", {}).get("steps", []):
                step += 1
                metrics.update(critic_steps.pop(0) if critic_steps else {})
                metrics.update(busy, wall_time_s=time.perf_counter() - started, recoveries=float(len(health.recoveries)))
                if t.eval_every and step % t.eval_every == 0 and step < t.steps:
                    metrics.update(evaluator())
                writer.write(step, metrics)
            for fault in [f for f in pending_faults if f.at_step <= step]:
                pending_faults.remove(fault)
                echo(f"injecting fault: {fault.kind} {fault.role} after step {step}")
                controller.call(fault.role, "inject_fault", fault.kind)
                health.fault_injected(fault.role)
            if t.time_budget_s is not None and time.perf_counter() - started > t.time_budget_s:
                echo(f"time budget of {t.time_budget_s:.0f}s reached after {step} steps")
                break
        controller.call("rollout", "stop")
        prompts = controller.prompts.state()
        controller.call("actor", "call", "save_checkpoint", str(checkpoint_path(run_dir, step)),
                        {"loop_step": step, "data_position": prompts["position"], "totals": {}})
        (run_dir / "health.json").write_text(json.dumps({"recoveries": health.report(), "prompts": prompts,
                                                         "bus": controller.bus.metrics()}, indent=2))
        final = evaluator()
        final["wall_time_s"] = time.perf_counter() - started
        writer.write(step, final)
    finally:
        writer.close()
        controller.shutdown()
    plot_run(run_dir)
    return run_dir
