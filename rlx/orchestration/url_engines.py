"""Rollout engines added by URL: servers that already run somewhere join a live async run.

Each one becomes its own one-replica Serve application: a rollout RoleService whose engine is the
`sglang` adapter or the `vllm` URL adapter pointed at the server (`rollout.engine_options.url`),
so it is a rollout replica like any other. It subscribes to DCS and sends the latest published weights to the server over the
adapter's weight-update path before it takes a prompt group; it takes groups from the shared
PromptSource under the same staleness gate and writes its samples to the same bus; the
HealthManager sees its beats. What is particular to it lives here: the server is checked before it
is added, probed every poll while it is in the run, and dropped when it stops answering (its relay
is killed and its unfinished groups go back to the queue: no restart, nothing replaces it).

A probe runs on a thread pool, never on the driver's loop: each poll takes the answers of the probes
that finished and starts the next ones. A probe has a wall-clock deadline (a server that trickles
its reply byte by byte is cut off there) and reads at most `PROBE_MAX_BYTES`; one still running
past its deadline counts as unanswered.

States (GET /v1/rollout/engines): `pending` (its relay is being placed), `loading` (the relay is
starting and the latest weights go to the server), `active` (it serves), `draining` (removed: it
takes no new group and finishes the ones it holds, then leaves the list).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests

from rlx.config import RunConfig
from rlx.engines.generation.server_client import ServerError, check_response, excerpt, is_loopback, read_reply
from rlx.orchestration.api import EngineConflict, EngineRejected, UnknownEngine

# kinds with an adapter that drives a server by URL, and the route that answers when the server is up
# and serves what the adapter needs (vLLM's /weight_info exists only with its RL API on)
PROBE_ROUTES = {"sglang": "/get_model_info", "vllm": "/weight_info"}
MAX_URL_ENGINES = 16
PROBE_TIMEOUT_S = 5.0  # wall clock, the whole probe: connect, headers and body
PROBE_MAX_BYTES = 16 << 20  # vLLM's /weight_info lists every weight's name, dtype and shape
DEAD_AFTER_PROBES = 3  # consecutive unanswered probes (one per driver poll) before a server counts as gone


def normalize_url(url: str) -> str:
    """`scheme://host:port` with an explicit port, lower case, no trailing slash: one server, one key."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.query or parts.fragment \
            or parts.username or parts.password or parts.path not in ("", "/"):
        raise EngineRejected(f"url={url!r} is not a server's base URL: give http(s)://host:port "
                             "(no path, query or credentials), e.g. http://127.0.0.1:30000")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port or (443 if parts.scheme == 'https' else 80)}"


def probe_once(url: str, kind: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the server at `url` is not a `kind` server that answers, or None when it is: its probe
    route (`PROBE_ROUTES`) must answer a JSON object (the adapter reads its `weight_version` there).
    Blocks up to about `timeout_s` (a reply's body is cut off there); `probe` bounds it exactly."""
    route = PROBE_ROUTES[kind]
    deadline = time.monotonic() + timeout_s
    session = requests.Session()
    session.trust_env = not is_loopback(url)  # as the adapter: no proxy for a local server
    try:
        response = session.get(url + route, timeout=timeout_s, stream=True)
        text = read_reply(response, route, url, PROBE_MAX_BYTES, deadline)
        info = check_response(route, response.status_code, text, server=url)
    except requests.RequestException as error:
        return f"{type(error).__name__}: {excerpt(str(error), 200)}"
    except ServerError as error:  # not 2xx, not JSON, too big or too slow
        return str(error)
    finally:
        session.close()
    return None if isinstance(info, dict) else f"GET {route} answered {excerpt(str(info), 100)}, not an object"


PROBES = ThreadPoolExecutor(2 * MAX_URL_ENGINES, thread_name_prefix="rlx-url-probe")


def probe(url: str, kind: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """`probe_once` on the probe pool, answered within `timeout_s` whatever the server does."""
    try:
        return PROBES.submit(probe_once, url, kind, timeout_s).result(timeout=timeout_s)
    except FutureTimeout:
        return late(timeout_s)


def late(timeout_s: float) -> str:
    return f"no complete answer within {timeout_s:g}s"


KEY_OPTIONS = ("api_key", "api_key_env")  # a server's credentials: never sent to another server


def url_engine_config(config: RunConfig, url: str, kind: str) -> dict[str, Any]:
    """The run's config with its rollout engine pointed at `url`. The run's own engine_options carry
    over when the run already drives a `kind` server by URL (timeouts, concurrency), but not its API
    key, which belongs to the run's own server. What `auto` resolved to for the run is pinned, so
    the relay writes the same bus fields as every other rollout replica."""
    raw = config.model_dump(mode="json")
    by_url = config.rollout.engine == kind and "url" in config.rollout.engine_options
    options = {k: v for k, v in config.rollout.engine_options.items() if k not in KEY_OPTIONS} if by_url else {}
    raw["rollout"].update(engine=kind, engine_options={**options, "url": url})
    raw["algorithm"].update(behavior_correction=config.algorithm.resolved_correction,
                            routing_replay=config.routing_replay)
    return raw


@dataclass
class UrlEngine:
    id: str
    url: str
    kind: str
    key: str  # its Serve application among the controller's handles
    draining: bool = False
    unanswered: int = 0  # consecutive probes the server did not answer
    probing: Future | None = field(default=None, repr=False)  # the probe in flight
    probe_started: float = 0.0  # when it started (monotonic)

    def info(self, state: str) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "engine": self.kind, "state": state}


class UrlEngines:
    """The engines added by URL to one run; the driver calls `observe` at every poll."""

    def __init__(self, controller: Any, health: Any, echo: Callable[[str], None] = print) -> None:
        self.controller, self.health, self.echo = controller, health, echo
        self.engines: dict[str, UrlEngine] = {}
        self.numbers = itertools.count(1)
        self.events: list[dict[str, Any]] = []  # added, removed, dropped: for health.json
        self.changing = threading.Lock()  # API threads add and remove; the driver's poll only drops

    def add(self, url: str, kind: str) -> dict[str, Any]:
        with self.changing:  # two requests for one URL: the second sees the first
            return self._add(url, kind)

    def _add(self, url: str, kind: str) -> dict[str, Any]:
        if kind not in PROBE_ROUTES:
            raise EngineRejected(f"engine={kind!r} cannot be added by URL: rlx drives {', '.join(PROBE_ROUTES)} "
                                 "servers by URL (other engines run in a rollout replica: scale those with "
                                 "/v1/rollout/scale)")
        if kind == "vllm" and self.controller.config.routing_replay == "r3":
            raise EngineRejected("engine='vllm' cannot be added to this run: it replays the rollout's expert routes "
                                 "(algorithm.routing_replay=r3), which rlx's vllm URL adapter does not report; add "
                                 "an sglang server, or scale the run's own rollout with /v1/rollout/scale")
        url = normalize_url(url)
        if any(e.url == url for e in self.engines.values()):
            raise EngineConflict(f"url={url} is already a rollout engine of this run (GET /v1/rollout/engines); "
                                 "remove it first to add it again")
        if len(self.engines) >= MAX_URL_ENGINES:
            raise EngineConflict(f"this run already has {MAX_URL_ENGINES} rollout engines added by URL; "
                                 "remove one (DELETE /v1/rollout/engines/<id>) first")
        problem = probe(url, kind)
        if problem is not None:
            raise EngineRejected(f"url={url}: no {kind} server answered GET {PROBE_ROUTES[kind]} ({problem}); start "
                                 "the server first (a vLLM server with VLLM_SERVER_DEV_MODE=1), or check the host "
                                 "and port")
        engine_id = f"url-{next(self.numbers)}"
        key = self.controller.deploy_url_engine(engine_id, url_engine_config(self.controller.config, url, kind))
        engine = self.engines[engine_id] = UrlEngine(engine_id, url, kind, key)
        self._event(engine, "added", "its relay loads the latest weights into it, then it serves")
        return engine.info("pending")

    def remove(self, engine_id: str) -> dict[str, Any]:
        with self.changing:
            return self._remove(engine_id)

    def _remove(self, engine_id: str) -> dict[str, Any]:
        engine = self.engines.get(engine_id)
        if engine is None:
            raise UnknownEngine(f"no rollout engine added by URL has id {engine_id!r}: GET /v1/rollout/engines lists "
                                "them (Serve replicas are scaled with POST /v1/rollout/scale)")
        if not engine.draining:
            engine.draining = True
            self.controller.remove_app(engine.key)
            self._event(engine, "removed", "it drains, then leaves")
        return engine.info("draining")

    def observe(self) -> None:
        """Take the answers of the probes that finished (a probe past its deadline is unanswered), drop
        the servers that stopped answering, start the next probes; forget drained engines. Never waits."""
        for engine in list(self.engines.values()):
            if engine.draining:
                if not self._beating(engine.id) and not self.controller.app_running(engine.key):
                    self._forget(engine)
                continue
            answered = self._answer(engine)
            if answered is None:
                continue
            problem = answered[0]
            engine.unanswered = 0 if problem is None else engine.unanswered + 1
            if engine.unanswered >= DEAD_AFTER_PROBES:
                self._drop(engine, f"its server stopped answering ({problem})")
            elif problem is None and (failed := self.controller.app_failure(engine.key)) is not None:
                # the server answers but the relay cannot start: e.g. it serves another model
                self._drop(engine, f"its relay could not start: {excerpt(failed, 500)}")

    def _answer(self, engine: UrlEngine) -> tuple[str | None] | None:
        """(the finished probe's problem or None,), or None while a probe runs within its deadline.
        Starts the next probe when none is in flight; a late one is left to end on its own (no
        second probe of the same server meanwhile)."""
        answer = None
        if engine.probing is not None and engine.probing.done():
            answer, engine.probing = (engine.probing.result(),), None
        elif engine.probing is not None:
            return (late(PROBE_TIMEOUT_S),) if time.monotonic() - engine.probe_started > PROBE_TIMEOUT_S else None
        engine.probing = PROBES.submit(probe_once, engine.url, engine.kind, PROBE_TIMEOUT_S)
        engine.probe_started = time.monotonic()
        return answer

    def probes_finished(self, timeout_s: float = 2 * PROBE_TIMEOUT_S) -> None:
        """Wait for the probes in flight (tests: the next `observe` then sees their answers)."""
        for engine in list(self.engines.values()):
            if engine.probing is not None:
                try:
                    engine.probing.result(timeout=timeout_s)
                except FutureTimeout:  # still late: the next `observe` counts it unanswered
                    pass

    def _drop(self, engine: UrlEngine, why: str) -> None:
        self.controller.remove_app(engine.key)
        rows, groups = self.health.retire_engine(engine.id)
        self._forget(engine)
        self._event(engine, "dropped", f"{why}; {groups} prompt groups handed out again", rows_released=rows,
                    groups_requeued=groups, reason=why)

    def _forget(self, engine: UrlEngine) -> None:
        del self.engines[engine.id]
        self.controller.heartbeats.clear_phase(engine.id)

    def _event(self, engine: UrlEngine, what: str, detail: str = "", **extra: Any) -> None:
        self.events.append({"event": what, "id": engine.id, "url": engine.url, "at": time.time(), **extra})
        self.echo(f"rollout engine {engine.id} ({engine.url}) {what}" + (f": {detail}" if detail else ""))

    def _beating(self, engine_id: str) -> list[dict[str, Any]]:
        return [beat for beat in self.health.live.values() if beat["status"].get("engine_id") == engine_id]

    def listing(self) -> list[dict[str, Any]]:
        """Every engine added by URL with its state; an active one also with its replica's status."""
        phases = self.controller.heartbeats.phases()
        out = []
        for engine in self.engines.values():
            beats = self._beating(engine.id)
            if beats:
                status = beats[0]["status"]
                state = "draining" if engine.draining else status.get("state", "active")
                out.append({**status, "replica": status["consumer"], "silent_s": beats[0]["silent_s"],
                            **engine.info(state)})
            else:
                out.append(engine.info("draining" if engine.draining else phases.get(engine.id, "pending")))
        return out
