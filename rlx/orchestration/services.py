"""Role services: the body of each Ray Serve deployment in async mode.

A service builds its one role from the RunConfig, wires it to the bus and the weight store, and
runs the role's worker loop on a thread. Serve gives it its own process, resources and health
check; `check_health` fails once the worker loop has died, so Serve replaces the replica.
"""

from __future__ import annotations

from typing import Any, Callable

from rlx.bus.ray_bus import Bus
from rlx.config import RunConfig
from rlx.data import PromptStream, load_splits
from rlx.models import load_tokenizer
from rlx.orchestration.builder import (
    actor_fwd_worker,
    actor_worker,
    advantages_worker,
    build_actor,
    build_actor_fwd,
    build_advantages,
    build_critic,
    build_reference,
    build_reward_role,
    build_rollout,
    build_teacher,
    critic_worker,
    model_path,
    prepare_process,
    reference_worker,
    reward_worker,
    rollout_worker,
    teacher_worker,
)
from rlx.orchestration.workers import Worker
from rlx.weights.store import WeightStore


def _rollout(cfg: RunConfig, bus: Bus, weights: WeightStore) -> Worker:
    rollout = build_rollout(cfg, model_path(cfg))
    stream = PromptStream(load_splits(cfg.data)[0], seed=cfg.data.seed)
    return rollout_worker(cfg, rollout, bus, stream,
                          lambda: weights.pull(rollout.engine.weight_version, rollout.load_weights),
                          cfg.train.max_staleness)


def _actor(cfg: RunConfig, bus: Bus, weights: WeightStore) -> Worker:
    actor = build_actor(cfg, model_path(cfg))
    weights.publish(actor.weights(), actor.version)  # version 0: what every engine starts from
    return actor_worker(cfg, actor, bus, publish=lambda: weights.publish(actor.weights(), actor.version),
                        max_staleness=cfg.train.max_staleness, with_actor_fwd=uses_actor_fwd(cfg),
                        max_steps=cfg.train.steps)


def _actor_fwd(cfg: RunConfig, bus: Bus, weights: WeightStore) -> Worker:
    actor_fwd = build_actor_fwd(cfg, model_path(cfg))
    return actor_fwd_worker(cfg, actor_fwd, bus,
                            lambda: weights.pull(actor_fwd.weight_version, actor_fwd.load_weights))


def uses_actor_fwd(cfg: RunConfig) -> bool:
    """Decoupled PPO needs the proximal policy's log-probs from a separate forward pass."""
    return cfg.algorithm.behavior_correction == "decoupled"


def _teacher(cfg: RunConfig, bus: Bus, weights: WeightStore) -> Worker:
    return teacher_worker(cfg, build_teacher(cfg, len(load_tokenizer(model_path(cfg)))), bus)


def _reward(cfg: RunConfig, bus: Bus, weights: WeightStore) -> Worker:
    return reward_worker(cfg, build_reward_role(cfg), bus)


SERVICE_BUILDERS: dict[str, Callable[[RunConfig, Bus, WeightStore], Worker]] = {
    "rollout": _rollout,
    "reward": _reward,
    "genrm": _reward,  # the judge model's own service, in the reward role's place
    "advantages": lambda cfg, bus, weights: advantages_worker(cfg, build_advantages(cfg), bus),
    "reference": lambda cfg, bus, weights: reference_worker(cfg, build_reference(cfg, model_path(cfg)), bus),
    "critic": lambda cfg, bus, weights: critic_worker(cfg, build_critic(cfg), bus),
    "teacher": _teacher,
    "actor_fwd": _actor_fwd,
    "actor": _actor,
}


class RoleService:
    def __init__(self, role: str, config: dict[str, Any], bus: Bus, weights: WeightStore) -> None:
        cfg = RunConfig.model_validate(config)
        prepare_process(cfg, threads=getattr(cfg.resources, role).threads)
        self.role = role
        self.worker = SERVICE_BUILDERS[role](cfg, bus, weights)

    def start(self) -> None:
        self.worker.run_forever()

    def stop(self) -> None:
        self.worker.stop()

    def status(self) -> dict[str, Any]:
        return self.worker.status()

    def call(self, method: str, *args: Any) -> Any:
        """Run a role-specific method of the worker (e.g. the actor's checkpoint)."""
        return getattr(self.worker, method)(*args)

    def check_health(self) -> None:
        if self.worker.error:
            raise RuntimeError(f"{self.role} worker stopped: {self.worker.error}")
