"""Async mode: every role is its own Ray Serve deployment; they meet on the bus.

The driver only watches: it collects the Actor's (and Critic's) step metrics, reads every
replica's heartbeat, lets the HealthManager recover dead replicas' work, injects configured
faults, evaluates on the held-out split, serves the management API, and shuts everything down on
success, error or Ctrl-C.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from rlx.config import RunConfig, lost_actor_cost
from rlx.data import PromptRow
from rlx.engines.generation.base import SamplingParams
from rlx.obs import Alerts, MetricsWriter, plot_run
from rlx.obs.timeline import SPANS, run_folder
from rlx.orchestration.api import ApiServer, ScaleInProgress, ScaleRefused, ScaleTimedOut
from rlx.orchestration.autoscaler import Autoscaler
from rlx.orchestration.builder import (
    build_reward_role,
    build_rollout,
    load_data,
    model_path,
    prepare_process,
    prompt_encoder,
    sampling_params,
)
from rlx.orchestration.controller import CALL_TIMEOUT_S, DRAIN_S, STOP_AFTER_FAILURE_S, Controller
from rlx.orchestration.evaluation import evaluate
from rlx.orchestration.faults import DriverFaults
from rlx.orchestration.health import HealthManager, RoleFailed
from rlx.orchestration.plan import build_plan
from rlx.orchestration.reports import Cursor
from rlx.orchestration.run_dir import latest_checkpoint, prepare_run_dir
from rlx.orchestration.url_engines import UrlEngines
from rlx.roles import GenRM, Reward
from rlx.weights.sync import CoordinatorUnavailable, WeightReader, WeightSync

POLL_S = 2.0  # status round trips cost CPU the roles need
SHARED_HOLDS = {"bus": "every row not trained yet", "prompts": "the data order and the groups in flight",
                "heartbeats": "every replica's heartbeat"}


@dataclass(frozen=True)
class RunInputs:
    """What the driver reads once before any service starts: both data splits and the reward."""

    train_rows: list[PromptRow]
    eval_rows: list[PromptRow]
    reward: Reward | GenRM


class DriverEvaluator:
    """Greedy held-out evaluation in the driver, on the latest published weights."""

    def __init__(self, config: RunConfig, weights: WeightSync, rows: list[PromptRow], reward: Reward | GenRM) -> None:
        self.config, self.weights = config, WeightReader(weights)
        self.rows, self.reward = rows, reward
        self.rollout = build_rollout(config, model_path(config))
        self.encode = prompt_encoder(config, self.rollout)
        self.params: SamplingParams = sampling_params(config, seed=0, greedy=True)

    def __call__(self) -> dict[str, float]:
        with SPANS.span("evaluate", "driver"):
            self.weights.pull(self.rollout.load_weights)
            metrics = evaluate(self.rollout, self.reward, self.rows, self.encode, self.params)
        return {**metrics, "eval_weight_version": float(self.rollout.version)}

    def close(self) -> None:
        """Release the reward's process pool now, not whenever the garbage collector runs."""
        self.reward.close()


class AsyncRun:
    """One async run, and the RunControl the management API drives."""

    def __init__(self, config: RunConfig, run_dir: Path, echo: Callable[[str], None], alerts: Alerts,
                 faults: DriverFaults, inputs: RunInputs) -> None:
        self.config, self.run_dir, self.echo, self.alerts = config, run_dir, echo, alerts
        self.inputs = inputs
        self.controller, self.faults = Controller(config, echo), faults
        self.step = 0
        self.stop_requested = threading.Event()
        self.rollbacks: list = []  # global recoveries seen so far: (lost version, restored version)
        self.dcs_incarnation: str | None = None
        self.dcs_recoveries: list[dict[str, Any]] = []
        self.samples_rolled_back = 0
        self.cursors: dict[str, Cursor | None] = {"actor": None, "critic": None}  # the last report held
        self.scaling = threading.Lock()  # one scale operation at a time: the API's or the autoscaler's
        self.autoscaler: Autoscaler | None = None
        self.autoscaling: threading.Thread | None = None
        self.scale_events: list[dict[str, Any]] = []
        self.url_engines: UrlEngines | None = None  # once the run's roles are deployed

    # -- RunControl ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        roles: dict[str, list] = {}
        for beat in self.health.live.values():
            roles.setdefault(beat["role"], []).append(beat["status"])
        return {"step": self.step, "steps": self.config.train.steps, "roles": roles,
                "recoveries": self.health.report() + self.dcs_recoveries, "prompts": self.controller.prompts.state(),
                "url_engines": self.url_engines.events}

    def engines(self) -> list[dict[str, Any]]:
        replicas = [{**beat, "id": beat["replica"], "engine": self.config.rollout.engine, "url": None}
                    for beat in self.health.replicas("rollout") if "engine_id" not in beat]
        return replicas + self.url_engines.listing()

    def add_engine(self, url: str, engine: str) -> dict[str, Any]:
        return self.url_engines.add(url, engine)

    def remove_engine(self, engine_id: str) -> dict[str, Any]:
        return self.url_engines.remove(engine_id)

    def scale(self, replicas: int, reason: str = "requested through the API") -> dict[str, Any]:
        """Refused once a stop was requested: the roles are shutting down (the driver holds `scaling`
        from then on, so none starts late either)."""
        stopping = ScaleRefused("the run is stopping (a stop was requested or its last step is done): no scale now")
        if not self.scaling.acquire(blocking=False):
            raise stopping if self.stop_requested.is_set() else ScaleInProgress("a scale operation is already running")
        if self.stop_requested.is_set():
            self.scaling.release()
            raise stopping
        try:
            self.echo(f"scaling rollout to {replicas} replicas ({reason})")
            started = time.monotonic()
            result = self.controller.scale_rollout(replicas)
            self.scale_events.append({"step": self.step, **result, "reason": reason,
                                      "seconds": time.monotonic() - started})
            return result
        finally:
            self.scaling.release()

    def checkpoint(self) -> str:
        """The Actor's checkpoint now, and the Critic's beside it (it also checkpoints on its own clock)."""
        state = {"data_position": self.controller.prompts.state()["position"], "totals": {}}
        if "critic" in self.controller.handles:
            self.controller.call_service("critic", "invoke_worker", "save_checkpoint")
        return self.controller.call_service("actor", "invoke_worker", "save_checkpoint", str(self.run_dir), state)

    def stop(self) -> None:
        self.stop_requested.set()

    # -- global recovery -------------------------------------------------------------------------
    def _reports(self, role: str) -> list[dict[str, float]]:
        """A trainer's finished steps not seen yet; none while it is lost (the HealthManager deals
        with that). A reply lost to a timeout is handed out again by the next call."""
        try:  # while the role is down the call waits for its replacement: not for long
            reports = self.controller.call_service(role, "invoke_worker", "reported_after", self.cursors[role], timeout_s=POLL_S * 5)
        except (ray.exceptions.RayError, TimeoutError) as error:
            self.echo(f"{role} unreachable ({type(error).__name__}); waiting for the health checks")
            return []
        if reports:
            self.cursors[role] = reports[-1][0]
        return [metrics for _, metrics in reports]

    def _follow_weights(self) -> None:
        """A restarted Actor published its checkpoint's weights as a rollback: the steps after the
        checkpoint are lost (their samples were trained into updates that died with the Actor), so
        the step count goes back and their prompt groups give their place to new ones. A replaced
        coordinator starts a new incarnation, with no rollbacks yet."""
        try:  # a coordinator being replaced is looked at again at the next poll
            status = self.controller.weights.ask("status", reply_s=POLL_S, patience_s=POLL_S)
        except CoordinatorUnavailable:
            return
        if status["incarnation"] != self.dcs_incarnation:
            if self.dcs_incarnation is not None:
                self._dcs_replaced()
            self.dcs_incarnation, self.rollbacks = status["incarnation"], []
        rollbacks = status["rollbacks"]
        for lost, restored in rollbacks[len(self.rollbacks):]:
            steps = max(0, lost - restored)
            self.controller.prompts.rollback(steps)
            self.step = restored
            self.samples_rolled_back += steps * self.config.rollout.prompts_per_step * self.config.rollout.n
            redo = f"steps {restored + 1}-{lost} are redone" if steps else "no step was lost"
            message = f"global recovery: the actor restarted from its step-{restored} checkpoint; {redo}"
            self.echo(message)
            self.alerts.notify("recovery", message)
        self.rollbacks = rollbacks

    def _dcs_replaced(self) -> None:
        injected = self.health.faults_at.pop("dcs", None)
        after = None if injected is None else time.monotonic() - injected
        # the driver's calls wait for the replacement, so the loss is noticed when it serves again
        self.dcs_recoveries.append({"role": "dcs", "scope": "in place", "detected_after_s": after,
                                    "replaced_after_s": after, "others_serving": 0, "role_down_s": after})
        message = ("recovered dcs: Serve replaced the weight coordinator; the Actor's next version fills it "
                   "again and every subscriber registers again")
        self.echo(message)
        self.alerts.notify("recovery", message)

    def _check_shared(self, wait_s: float = 1.0) -> None:
        """A dead shared actor (the bus, the prompt source, the heartbeat board) stops the run with a
        message saying how to continue: Ray does not restart them, and what they held (rows, the data
        order) lives only in their memory and in the newest checkpoint."""
        lost = self.controller.lost_shared(wait_s)
        if not lost:
            return
        held = "; ".join(f"the {name} actor held {SHARED_HOLDS[name]}" for name in lost)
        checkpoint = latest_checkpoint(self.run_dir)
        then = (f"from its newest checkpoint ({checkpoint.name}) with the bus and the prompt source as they were "
                "then: nothing is lost or trained twice, the steps after it are redone" if checkpoint is not None
                else "from the start (no checkpoint yet)")
        raise RoleFailed(f"the run's {' and '.join(lost)} actor died after step {self.step} ({held}); the run stops "
                         f"here: `rlx train <config> --resume` continues {then}")

    # -- autoscaling -----------------------------------------------------------------------------
    def _autoscale(self) -> None:
        """Read the bus's back-pressure; start a scale operation in the background when due, so the
        loop keeps collecting steps while new replicas start."""
        if self.autoscaler is None or self.scaling.locked():
            return
        now = time.monotonic()
        self.autoscaler.observe(self.controller.bus.metrics().get("bus_waiting:train", 0.0), now)
        target = self.autoscaler.decide(self.controller.rollout_replicas, now)
        if target is None:
            return
        reason = f"autoscaler: back-pressure {self.autoscaler.back_pressure():.2f}"

        def scale() -> None:
            try:
                self.scale(target, reason)
            except ScaleInProgress:  # an API call got there first; the next window decides again
                self.echo(f"autoscaler: no scale to {target} replicas, an API scale operation is running")
            except (ScaleRefused, ScaleTimedOut) as error:  # the cluster cannot hold them (now); the run goes on
                self.echo(f"autoscaler: no scale to {target} replicas: {error}")
            finally:
                self.autoscaler.restart(time.monotonic())

        self.autoscaling = threading.Thread(target=scale, name="rlx-autoscale", daemon=True)
        self.autoscaling.start()

    def _stop_url_engines(self) -> None:
        """Like the rollout, they finish their groups before the final checkpoint; one still starting
        (or whose server is gone) is not waited for."""
        for engine in [e for e in self.url_engines.engines.values() if not e.draining]:
            try:
                self.controller.call_service(engine.key, "stop", timeout_s=DRAIN_S + 10)
            except (KeyError, ray.exceptions.RayError, TimeoutError) as error:
                self.echo(f"stopping rollout engine {engine.id}: {type(error).__name__}: {error}")

    # -- the loop --------------------------------------------------------------------------------
    def run(self, writer: MetricsWriter, started: float, resume: bool) -> None:
        cfg, t, c = self.config, self.config.train, self.controller
        checkpoint = latest_checkpoint(self.run_dir, resuming=True) if resume else None
        with SPANS.span("substrate", "driver"):  # Ray, Serve, the bus, DCS, the prompt source
            c.start_substrate(self.run_dir, self.inputs.train_rows, checkpoint)
        with SPANS.span("start", "evaluator"):
            evaluator = DriverEvaluator(cfg, c.weights, self.inputs.eval_rows, self.inputs.reward)
        if checkpoint is None:
            writer.write(0, evaluator())  # the initial weights, before any role competes for the CPU
        else:
            self.step = json.loads((checkpoint / "trainer_state.json").read_text())["loop_step"]
            self.echo(f"resumed from {checkpoint} at step {self.step}")
        with SPANS.span("start", "driver"):  # until every role's replicas are up
            c.deploy()
        # The Actor and the Critic each restart from their own newest checkpoint when lost.
        self.health = HealthManager(c.plan, c.bus, c.prompts, c.heartbeats, cfg.rollout.n, t.heartbeat_timeout_s,
                                    t.max_restarts_per_role, t.max_restarts, c.weights,
                                    global_recovery=c.plan.stateful_roles)
        self.url_engines = UrlEngines(c, self.health, self.echo)
        api = ApiServer(self, self.run_dir).start()
        if cfg.rollout.autoscale.enabled:
            r = cfg.rollout
            self.autoscaler = Autoscaler(r.autoscale, (t.max_staleness + 1) * r.prompts_per_step * r.n,
                                         time.monotonic())
        self.echo(f"management API on {api.url} (token in {self.run_dir / 'api_token'})")
        self.echo(f"recovery: {lost_actor_cost(cfg)}")
        critic_steps: list[dict[str, float]] = []
        self.faults.arm_actor(c.call_service)
        try:
            while self.step < t.steps and not self.stop_requested.is_set():
                time.sleep(POLL_S)
                self._check_shared()
                try:
                    recoveries = self.health.observe()
                except ray.exceptions.RayActorError:  # a shared actor died since the check: name it
                    self._check_shared(wait_s=10)
                    raise
                for r in recoveries:
                    restart = "restarts from the last checkpoint" if r.scope == "global" else "is replaced"
                    message = (f"recovered {r.role}: replica {r.replica} ({r.cause}) is gone and {restart}; {r.rows_released} "
                               f"rows back on the bus, {r.groups_requeued} prompt groups handed out again")
                    self.echo(message)
                    self.alerts.notify("recovery", message)
                self.url_engines.observe()
                self._follow_weights()
                self._autoscale()
                if "critic" in c.handles:
                    critic_steps.extend(self._reports("critic"))
                for metrics in self._reports("actor"):
                    self.step = int(metrics.pop("trainer_step"))
                    finished = metrics.pop("finished_at") - time.time() + time.perf_counter()
                    metrics.update(critic_steps.pop(0) if critic_steps else {})
                    metrics.update(self.health.busy(), wall_time_s=finished - started,
                                   recoveries=float(len(self.health.recoveries) + len(self.dcs_recoveries)),
                                   rollout_replicas=float(c.rollout_replicas))
                    if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                        metrics.update(evaluator())
                    writer.write(self.step, metrics)
                self.faults.fire_due(self.step, c.call_service, c.weights.inject_fault, self.health.fault_injected,
                                     self.echo, c.kill_shared)
                if t.time_budget_s is not None and time.perf_counter() - started > t.time_budget_s:
                    self.echo(f"time budget of {t.time_budget_s:.0f}s reached after {self.step} steps")
                    break
            self._check_shared()  # no final checkpoint from a dead bus or prompt source
            self.stop_requested.set()  # from here a scale request is refused (409)
            self.scaling.acquire()  # a scale operation in flight (the API's or the autoscaler's) finishes first
            if self.autoscaling is not None:
                self.autoscaling.join()
            self._stop_url_engines()
            for role in ("rollout", "actor"):  # the actor may be mid-step, waiting for rows that will not come
                c.call_service(role, "stop")
            self.checkpoint()
            (self.run_dir / "health.json").write_text(json.dumps(
                {"recoveries": self.health.report() + self.dcs_recoveries, "prompts": c.prompts.state(),
                 "bus": c.bus.metrics(),
                 "weights": c.weights.status(), "samples_rolled_back": self.samples_rolled_back,
                 "scaling": self.scale_events, "url_engines": self.url_engines.events}, indent=2))
            final = evaluator()
            final["wall_time_s"] = time.perf_counter() - started
            writer.write(self.step, final)
            self.alerts.notify("finished", f"{self.step} steps in {final['wall_time_s']:.0f}s; held-out accuracy "
                               f"{final.get('eval_accuracy', float('nan')):.3f}; "
                               f"{len(self.health.recoveries) + len(self.dcs_recoveries)} recoveries")
        finally:
            api.stop()
            evaluator.close()


def run_async(config: RunConfig, resume: bool = False, overwrite: bool = False,
              echo: Callable[[str], None] = print) -> Path:
    faults = DriverFaults(config, build_plan(config))  # a fault for a role the run lacks fails here
    run_dir = prepare_run_dir(config, resume, overwrite)
    SPANS.open(run_folder(run_dir), "driver")  # each role's replicas write their own (services.py)
    SPANS.record_launch()
    # bad data, a prompt over data.max_prompt_tokens or a reward that cannot load stop the run before any service;
    # loaded once here, for the prompt source and the driver's evaluation
    train_rows, eval_rows = load_data(config)
    with SPANS.span("start", "reward"):
        inputs = RunInputs(train_rows, eval_rows, build_reward_role(config))
    prepare_process(config)
    alerts = Alerts(config.logging.alerts, config.logging.name)
    started = time.perf_counter()
    run = AsyncRun(config, run_dir, echo, alerts, faults, inputs)
    writer = MetricsWriter.for_run(run_dir, config, echo=echo)
    stop_timeout_s = CALL_TIMEOUT_S
    try:
        run.run(writer, started, resume)
    except BaseException as exc:
        alerts.notify("failure", f"{type(exc).__name__}: {exc}")
        stop_timeout_s = STOP_AFTER_FAILURE_S  # a service may hang on a dead bus: the error is what matters
        raise
    finally:
        writer.close()
        run.controller.shutdown(stop_timeout_s)
        SPANS.close()
    plot_run(run_dir)
    return run_dir
