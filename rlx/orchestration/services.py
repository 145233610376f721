"""Role services: the body of each Ray Serve deployment in async mode.

A service builds its one role from the RunConfig, wires it to the bus, the weight store and the
prompt source, and starts the role's worker loop on a thread at once, so a replacement replica goes
back to work by itself. Serve gives it its own process, resources and health check;
`check_health` fails once the worker loop has died or stopped beating for `train.hang_timeout_s`,
and Serve replaces the replica. Each replica takes bus rows under its own consumer id, so the
HealthManager can hand a dead replica's unfinished rows back.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve

from rlx.bus.ray_bus import Bus
from rlx.config import RunConfig
from rlx.models import load_tokenizer
from rlx.obs.timeline import SPANS, run_folder
from rlx.orchestration.builder import (
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
    logprob_worker,
    model_path,
    prepare_process,
    reward_worker,
    rollout_worker,
)
from rlx.orchestration.faults import inject
from rlx.orchestration.plan import RolePlan, build_plan
from rlx.orchestration.prompt_source import PromptSourceClient
from rlx.orchestration.resume import capture_run_state
from rlx.orchestration.run_dir import latest_checkpoint
from rlx.orchestration.workers import Checkpointing, Worker
from rlx.run_state import load_run_state
from rlx.weights.sync import WeightSync


@dataclass
class Shared:
    """What every service of a run shares: the bus, the weight-sync handle, the prompt source and
    the heartbeat board (a Ray actor handle)."""

    bus: Bus
    weights: WeightSync
    prompts: PromptSourceClient
    heartbeats: Any
    run_dir: str | None = None  # the Actor starts from its newest checkpoint, if there is one


def run_dir_of(shared: Shared) -> Path | None:
    return Path(shared.run_dir) if shared.run_dir else None


def _subscribe(worker_of: Callable[[Callable[[], None]], Worker], shared: Shared, load) -> Worker:
    """A weight subscriber named after the replica's consumer id. It loads the latest published
    version before the worker exists (a new or restarted engine never serves older weights), and
    the worker applies newer versions through `sync_weights`."""
    subscriber = shared.weights.subscriber(shared.bus.consumer, load)
    subscriber.start()
    worker = worker_of(subscriber.apply)
    worker.on_stop.append(subscriber.close)
    return worker


def _rollout(cfg: RunConfig, plan: RolePlan, shared: Shared) -> Worker:
    rollout = build_rollout(cfg, model_path(cfg))
    # DCS hands over read-only object-store snapshots: the engine may keep them instead of copying
    return _subscribe(lambda sync: rollout_worker(cfg, plan, rollout, shared.bus, shared.prompts, sync,
                                                  consumer=shared.bus.consumer), shared,
                      lambda state, version: rollout.load_weights(state, version, shared=True))


def _exit_with_a_lost_rank(role) -> None:
    """A role's rank group is one fault domain with its replica: when a rank dies the replica
    exits as a crashed one would, Serve replaces it, and the HealthManager recovers the role (a
    trainer from its last checkpoint; a worker that merely raised would stop the run instead)."""
    if hasattr(role, "on_rank_lost"):
        role.on_rank_lost = lambda: os._exit(1)


def _actor(cfg: RunConfig, plan: RolePlan, shared: Shared) -> Worker:
    actor, publisher = build_actor(cfg, model_path(cfg)), shared.weights.publisher(refill=True)
    _exit_with_a_lost_rank(actor)
    checkpoints = Checkpointing(run_dir_of(shared), cfg.train.checkpoint_every,
                                capture=lambda: capture_run_state(shared.bus, shared.prompts))
    worker = actor_worker(cfg, plan, actor, shared.bus,
                          publish=lambda: actor.publish(publisher),
                          max_staleness=cfg.train.max_staleness, max_steps=cfg.train.steps, checkpoints=checkpoints)
    # A resumed run, or a global recovery after the Actor was lost mid-run, starts from the newest
    # checkpoint; the rollback publish makes every engine drop weights newer than it.
    checkpoint = latest_checkpoint(Path(shared.run_dir), resuming=True) if shared.run_dir else None
    if checkpoint is not None:
        actor.load(checkpoint)
        worker.restore(load_run_state(checkpoint))
    actor.publish(publisher, rollback=True)
    worker.on_stop.append(publisher.close)
    return worker


def _critic(cfg: RunConfig, plan: RolePlan, shared: Shared) -> Worker:
    """The Critic holds the value model's optimizer state: a replacement after a loss starts from
    the Critic's own newest checkpoint (a value model a few steps old; the policy is unaffected)."""
    critic = build_critic(cfg)
    _exit_with_a_lost_rank(critic)
    checkpoints = Checkpointing(run_dir_of(shared), cfg.train.checkpoint_every)
    worker = critic_worker(cfg, plan, critic, shared.bus, checkpoints)
    checkpoint = latest_checkpoint(Path(shared.run_dir), "critic", resuming=True) if shared.run_dir else None
    if checkpoint is not None:
        critic.load(checkpoint)
    return worker


def _reference(cfg: RunConfig, plan: RolePlan, shared: Shared) -> Worker:
    """A frozen reference needs no weights after its start; one that follows the policy subscribes
    to DCS and takes a version when its refresh is due (a replacement starts from the latest)."""
    reference = build_reference(cfg, model_path(cfg))
    _exit_with_a_lost_rank(reference)
    if not reference.refresh_every:
        return logprob_worker(cfg, plan, "reference", reference, shared.bus)
    return _subscribe(lambda sync: logprob_worker(cfg, plan, "reference", reference, shared.bus, sync), shared,
                      reference.refresh)


def _actor_fwd(cfg: RunConfig, plan: RolePlan, shared: Shared) -> Worker:
    actor_fwd = build_actor_fwd(cfg, model_path(cfg))
    _exit_with_a_lost_rank(actor_fwd)
    return _subscribe(lambda sync: logprob_worker(cfg, plan, "actor_fwd", actor_fwd, shared.bus, sync), shared,
                      actor_fwd.load_weights)


def _teacher(cfg: RunConfig, plan: RolePlan, shared: Shared) -> Worker:
    teacher = build_teacher(cfg, len(load_tokenizer(model_path(cfg))))
    _exit_with_a_lost_rank(teacher)
    return logprob_worker(cfg, plan, "teacher", teacher, shared.bus)


def _reward(cfg: RunConfig, plan: RolePlan, shared: Shared) -> Worker:
    return reward_worker(cfg, plan, build_reward_role(cfg), shared.bus)


SERVICE_BUILDERS: dict[str, Callable[[RunConfig, RolePlan, Shared], Worker]] = {
    "rollout": _rollout,
    "reward": _reward,
    "genrm": _reward,  # the judge model's own service, in the reward role's place
    "advantages": lambda cfg, plan, shared: advantages_worker(cfg, plan, build_advantages(cfg), shared.bus),
    "reference": _reference,
    "critic": _critic,
    "teacher": _teacher,
    "actor_fwd": _actor_fwd,
    "actor": _actor,
}


HEARTBEAT_S = 1.0


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RuntimeError:  # not inside a Serve replica (tests build services in-process)
        return uuid.uuid4().hex[:8]


class RoleService:
    def __init__(self, role: str, config: dict[str, Any], shared: Shared, engine_id: str | None = None) -> None:
        """`engine_id`: a rollout engine added by URL (`config` points the engine at its server); it
        says it is loading until its first beat, and every beat carries its id."""
        cfg = RunConfig.model_validate(config)
        prepare_process(cfg, threads=getattr(cfg.resources, role).threads)
        self.role, self.hang_timeout_s, self.engine_id = role, cfg.train.hang_timeout_s, engine_id
        self.consumer = f"{role}-{replica_id()}"
        self.heartbeats = shared.heartbeats
        self.draining = False
        if engine_id is not None:
            self.heartbeats.announce.remote(engine_id, "loading")
        if shared.run_dir is not None:  # spans go to the run directory: it must be reachable from here
            SPANS.open(run_folder(Path(shared.run_dir)), self.consumer)
        shared = Shared(shared.bus.for_consumer(self.consumer), shared.weights, shared.prompts, shared.heartbeats,
                        shared.run_dir)
        with SPANS.span("start", role):  # the role's model, and the first weights for an engine
            self.worker = SERVICE_BUILDERS[role](cfg, build_plan(cfg), shared)
        self.worker.run_forever()
        self.stopped = threading.Event()
        self.failure: str | None = None  # why the health check failed, if it did
        threading.Thread(target=self._beat_forever, name="rlx-heartbeat", daemon=True).start()

    def _beat_forever(self) -> None:
        actor_name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
        while not self.stopped.is_set():  # the first beat at once: a replacement counts as back from it
            self.heartbeats.beat.remote(self.role, self.consumer, {**self.status(), "actor_name": actor_name})
            self.stopped.wait(HEARTBEAT_S)

    def stop(self) -> None:
        """Finish in-flight work (a rollout completes the groups it started), then say goodbye."""
        self.draining = True
        self.worker.stop()
        self.stopped.set()
        SPANS.flush()  # and it keeps writing: the driver's final checkpoint comes after the Actor stops
        goodbye = {**self.status(), "stopped": True, "failure": self.failure}
        try:
            ray.get(self.heartbeats.beat.remote(self.role, self.consumer, goodbye), timeout=10)
        except ray.exceptions.RayError:  # the run is shutting down: nobody is listening any more
            pass

    def __del__(self) -> None:  # Serve calls this when it removes the replica (scale-in, shutdown)
        if hasattr(self, "stopped") and not self.stopped.is_set():
            self.stop()

    def status(self) -> dict[str, Any]:
        state = {"state": "draining" if self.draining else "active"}
        if self.engine_id is not None:
            state["engine_id"] = self.engine_id
        return {**self.worker.status(), "consumer": self.consumer, **state}

    def invoke_worker(self, method: str, *args: Any) -> Any:
        """Run a role-specific method of the worker (e.g. the actor's checkpoint)."""
        return getattr(self.worker, method)(*args)

    def schedule_fault(self, kind: str, at_step: int) -> None:
        """Fault injection at the trainer's own step (the Actor): exact, where the driver's view lags."""
        # fired by the worker itself, right after that step: a kill exits at once, before another step runs
        self.worker.step_faults.schedule(at_step, lambda: inject(kind, self.worker, delay_s=0))

    def inject_fault(self, kind: str) -> None:
        """Fault injection (`faults` in the config): die a moment after answering, or hang."""
        inject(kind, self.worker)

    def check_health(self) -> None:
        silent = time.monotonic() - self.worker.last_beat
        if self.worker.error:
            self.failure = f"{self.role} worker stopped: {self.worker.error}"
        elif silent > self.hang_timeout_s:
            self.failure = (f"{self.role} is hung: no progress for {silent:.0f}s "
                            f"(train.hang_timeout_s={self.hang_timeout_s:.0f})")
        if self.failure:
            raise RuntimeError(self.failure)
