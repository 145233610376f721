"""The Controller: starts what a run shares (Ray, Serve, the bus, the weight store, the prompt
source, the heartbeat board), deploys one Serve application per role, scales the rollout, and
shuts everything down. The async loop that drives a run lives in `async_run.py`.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray import serve

from rlx.bus.ray_bus import Bus
from rlx.config import RunConfig
from rlx.data import PromptRow
from rlx.orchestration.builder import prompt_source
from rlx.orchestration.cluster import start_ray, stop_ray
from rlx.orchestration.heartbeats import RemoteHeartbeats
from rlx.orchestration.plan import build_plan, bus_schema
from rlx.orchestration.prompt_source import PromptSourceClient, RemotePromptSource
from rlx.orchestration.resume import resume_plan
from rlx.orchestration.scaling import redeploy, require_placeable
from rlx.orchestration.services import RoleService, Shared
from rlx.run_state import load_run_state
from rlx.weights.sync import WeightSync

DRAIN_S = 60  # a removed rollout replica finishes its groups within this, or they are handed out again
URL_ENGINE_CPUS = 0.25  # the relay process of an engine added by URL: tokenizer, HTTP and bus only
URL_ENGINE_START_TRIES = 3


def run_id(config: RunConfig) -> str:
    """A short id of the run's directory (its absolute path), readable beside the run's name."""
    where = hashlib.sha1(str(config.run_dir.resolve()).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', config.logging.name)[:40]}-{where}"


class HeartbeatsClient:
    def __init__(self, actor: ray.actor.ActorHandle) -> None:
        self.actor = actor

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return ray.get(self.actor.snapshot.remote())

    def forget(self, replica: str) -> None:
        ray.get(self.actor.forget.remote(replica))

    def phases(self) -> dict[str, str]:
        return ray.get(self.actor.phase_board.remote())

    def clear_phase(self, engine_id: str) -> None:
        self.actor.clear_phase.remote(engine_id)


CALL_TIMEOUT_S = 600.0  # a checkpoint of a large model can take minutes; anything longer is a hang
STOP_AFTER_FAILURE_S = 10.0  # a failed run's services all stop within this, or Serve removes them as they are


class Controller:
    def __init__(self, config: RunConfig, echo: Callable[[str], None] = print) -> None:
        self.config, self.echo = config, echo
        self.plan = build_plan(config)
        self.run_id = run_id(config)
        self.deployment_nonce = uuid.uuid4().hex[:8]  # see `_service_target`
        self.handles: dict[str, Any] = {}
        self.rollout_replicas = config.initial_rollout_replicas
        self.started_ray = False
        self.weights: WeightSync | None = None  # the weight coordinator, once the substrate is up

    def start_substrate(self, run_dir: Path, train_rows: list[PromptRow], resume_from: Path | None = None) -> None:
        """`train_rows` feed the prompt source; `resume_from`: a checkpoint whose bus and
        prompt-source state the run continues from."""
        cfg = self.config
        self.started_ray = not ray.is_initialized()
        res = cfg.resources
        start_ray(res.ray_num_cpus, res.ray_address, res.ray_allow_unauthenticated)
        serve.start(proxy_location="Disabled")  # roles talk through handles and the bus, not HTTP
        self.bus = Bus.create(capacity=max(1024, 4 * cfg.rollout.prompts_per_step * cfg.rollout.n
                                           * (cfg.train.max_staleness + 2)), check_schema=bus_schema(cfg))
        w = cfg.weights
        self.weights = WeightSync.create(w.channel, w.bucket_mb, w.timeout_s)
        source = prompt_source(cfg, train_rows)
        self.prompts = PromptSourceClient(RemotePromptSource.remote(source.stream, source.gate))
        beats = RemoteHeartbeats.remote()
        self.heartbeats = HeartbeatsClient(beats)
        self.shared = Shared(self.bus, self.weights, self.prompts, beats,
                             str(run_dir))
        if resume_from is not None:
            self._restore(load_run_state(resume_from))

    def _restore(self, run_state: dict[str, Any]) -> None:
        """Groups unfinished at the checkpoint (fewer than n rows made) are made again; every other
        row returns to the bus, handed again to any task whose output it lacks. The Critic resumes
        from its own newest checkpoint, taken on its own clock: it trains again on the rows it
        took that are still on the bus, as after a lost Critic."""
        bus, prompts = resume_plan(run_state, self.config.rollout.n, self.plan.task_outputs,
                                   retake=frozenset(self.plan.final_tasks) - {"train"})
        self.bus.restore(bus)
        self.prompts.resume(prompts)

    def _target(self, role: str, replicas: int) -> serve.RunTarget:
        res = getattr(self.config.resources, role)
        return self._service_target(role, role, replicas, self.config.model_dump(mode="json"),
                                    {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus})

    def _service_target(self, key: str, role: str, replicas: int, config: dict[str, Any],
                        actor_options: dict[str, Any], engine_id: str | None = None) -> serve.RunTarget:
        """The Serve application `key` of this run: `replicas` RoleServices of `role`."""
        deployment = serve.deployment(
            RoleService, name=self.app_name(key), num_replicas=replicas, ray_actor_options=actor_options,
            health_check_period_s=1, health_check_timeout_s=60, max_ongoing_requests=8,
            graceful_shutdown_timeout_s=DRAIN_S if role == "rollout" else 5,
            # an engine added by URL that cannot start (its server holds another model) fails soon and is dropped
            **({"max_constructor_retry_count": URL_ENGINE_START_TRIES} if engine_id is not None else {}),
        )
        # A version fixed for this driver makes a later change of num_replicas (scaling) a lightweight
        # update: Serve adds or removes replicas and leaves the running ones be. Without one, `serve.run`
        # stamps a random version and replaces every running replica (a drain and a restart for each).
        # The nonce keeps a resumed run (same application names, on a shared cluster) from keeping the
        # replicas of the driver it replaces, which hold handles to that driver's bus.
        deployment._version = f"{self.app_name(key)}-{self.deployment_nonce}"
        app = deployment.bind(role, config, self.shared, engine_id)
        return serve.RunTarget(app, name=self.app_name(key), route_prefix=None)

    def deploy_url_engine(self, engine_id: str, config: dict[str, Any]) -> str:
        """A rollout engine added by URL runs as its own one-replica application (its own fault
        domain, removed alone), a relay of `URL_ENGINE_CPUS`: its server does the generating.
        Returns its key among the handles; not waited for."""
        key = f"rollout-{engine_id}"
        require_placeable(key, {"CPU": URL_ENGINE_CPUS}, 1, "remove an engine added by URL, scale the rollout in, "
                          "or add nodes")
        target = self._service_target(key, "rollout", 1, config, {"num_cpus": URL_ENGINE_CPUS, "num_gpus": 0},
                                      engine_id)
        self.handles[key] = serve.run_many([target], wait_for_applications_running=False)[0]
        return key

    def remove_app(self, key: str) -> None:
        """Delete one application without waiting: Serve stops its replicas (a rollout drains first)."""
        self.handles.pop(key, None)
        serve.delete(self.app_name(key), _blocking=False)

    def app_running(self, key: str) -> bool:
        return self.app_name(key) in serve.status().applications

    def app_failure(self, key: str) -> str | None:
        """Serve's reason when application `key` failed to deploy (its replicas' constructors kept failing)."""
        status = serve.status().applications.get(self.app_name(key))
        if status is None or status.status != "DEPLOY_FAILED":
            return None
        return status.message or "no reason given"

    def app_name(self, role: str) -> str:
        """The Serve application of `role`, scoped to this run: two runs on one cluster never collide."""
        return f"rlx-{self.run_id}-{role}"

    def deploy(self) -> None:
        """One Serve application per role (its own fault domain), deployed in parallel; each role
        starts working as soon as its replicas are up (`resources.<role>.replicas`: they share the
        role's bus tasks, so a lost one's work goes on in the others while Serve replaces it)."""
        roles = self.plan.role_names
        targets = [self._target(role, self.rollout_replicas if role == "rollout"
                                else getattr(self.config.resources, role).replicas) for role in roles]
        self.handles = dict(zip(roles, serve.run_many(targets)))

    def scale_rollout(self, replicas: int) -> dict[str, int]:
        """Redeploy the rollout with `replicas` replicas; returns once they are all up. Refused when the
        cluster lacks the resources, undone past rollout.scale_timeout_s (see rlx.orchestration.scaling)."""
        before, res = self.rollout_replicas, self.config.resources.rollout
        require_placeable("rollout", {"CPU": res.num_cpus, "GPU": res.num_gpus}, replicas - before)
        self.handles["rollout"] = redeploy(self._target("rollout", replicas), replicas,
                                           self._target("rollout", before), self.config.rollout.scale_timeout_s)
        self.rollout_replicas = replicas
        return {"replicas_before": before, "replicas": replicas}

    def shared_actors(self) -> dict[str, ray.actor.ActorHandle]:
        """The run's shared Ray actors, none restarted by Ray: the bus (the rows live in its memory),
        the prompt source (the data order and who holds which group) and the heartbeat board."""
        return {"bus": self.bus.actor, "prompts": self.prompts.actor, "heartbeats": self.heartbeats.actor}

    def kill_shared(self, name: str, wait_s: float = 30.0) -> None:
        """Fault injection (`faults`, roles bus, prompts, heartbeats): kill one shared actor, and wait
        until it is gone, so the driver's next check finds it dead."""
        ray.kill(self.shared_actors()[name], no_restart=True)
        deadline = time.monotonic() + wait_s
        while name not in self.lost_shared() and time.monotonic() < deadline:
            time.sleep(0.1)

    def lost_shared(self, wait_s: float = 1.0) -> list[str]:
        """The shared actors that are dead now; one still busy after `wait_s` counts as alive."""
        probes = {name: actor.__ray_ready__.remote() for name, actor in self.shared_actors().items()}
        ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=wait_s)
        lost = []
        for name, probe in probes.items():
            try:
                if probe in ready:
                    ray.get(probe)
            except ray.exceptions.RayActorError:
                lost.append(name)
        return lost

    def call_service(self, role: str, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """A method of a role's service (`RoleService`); a service that does not answer in time is named in the error."""
        response = getattr(self.handles[role], method).remote(*args)
        try:
            return response.result(timeout_s=timeout_s)
        except TimeoutError as error:
            response.cancel()  # not left queued for a replacement replica to run later
            detail = f" {args[0]!r}" if method == "invoke_worker" and args else ""
            raise TimeoutError(f"the {role} service did not answer {method}{detail} within {timeout_s:.0f}s; "
                               f"see `rlx status` and the {role} replica's log") from error

    def shutdown(self, stop_timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Stop every role's service (each finishes its work and says goodbye), all of them within
        `stop_timeout_s` (short after a failure: a wedged service goes with Serve anyway), then Serve."""
        deadline = time.monotonic() + stop_timeout_s
        for role in reversed(list(self.handles)):
            try:
                self.call_service(role, "stop", timeout_s=max(1.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - a dead replica cannot stop; shutting Serve down removes it anyway
                self.echo(f"stopping {role}: {type(exc).__name__}: {exc}")
        if ray.is_initialized():
            if self.started_ray:  # every replica's stop() runs (spans flushed, goodbye beat), not only the one called
                serve.shutdown()
            else:  # a shared cluster: remove this run's applications only (deleting a missing one is a no-op)
                for key in {*self.plan.role_names, *self.handles}:
                    serve.delete(self.app_name(key))
                if self.weights is not None:
                    self.weights.close()
        if self.started_ray:
            stop_ray()
