"""Rollout engines added by URL: servers that already run somewhere join a live async run.

Each one becomes its own one-replica Serve application: a rollout RoleService whose engine is the
`sglang` adapter or the `vllm` URL adapter pointed at the server (`rollout.engine_options.url`),
so it is a rollout replica like any other. It subscribes to DCS and sends the latest published weights to the server over the
adapter's weight-update path before it takes a prompt group; it takes groups from the shared
PromptSource under the same staleness gate and writes its samples to the same bus; the
HealthManager sees its beats. What is particular to it lives here: the server is checked before it
is added, probed every poll while it is in the run, and dropped when it stops answering (its relay
is killed and its unfinished groups go back to the queue: no restart, nothing replaces it).

States (GET /v1/rollout/engines): `pending` (its relay is being placed), `loading` (the relay is
starting and the latest weights go to the server), `active` (it serves), `draining` (removed: it
takes no new group and finishes the ones it holds, then leaves the list).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests

from rlx.config import RunConfig
from rlx.engines.generation.server_client import check_response, excerpt, is_loopback
from rlx.orchestration.api import EngineConflict, EngineRejected, UnknownEngine

# kinds with an adapter that drives a server by URL, and the route that answers when the server is up
# and serves what the adapter needs (vLLM's /weight_info exists only with its RL API on)
PROBE_ROUTES = {"sglang": "/get_model_info", "vllm": "/weight_info"}
MAX_URL_ENGINES = 16
PROBE_TIMEOUT_S = 5.0
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


def probe(url: str, kind: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the server at `url` is not a `kind` server that answers, or None when it is: its probe
    route (`PROBE_ROUTES`) must answer a JSON object (the adapter reads its `weight_version` there)."""
    route = PROBE_ROUTES[kind]
    session = requests.Session()
    session.trust_env = not is_loopback(url)  # as the adapter: no proxy for a local server
    try:
        response = session.get(url + route, timeout=timeout_s)
        info = check_response(route, response.status_code, response.text, server=url)
    except requests.RequestException as error:
        return f"{type(error).__name__}: {excerpt(str(error), 200)}"
    except RuntimeError as error:  # ServerError: not 2xx, or not JSON
        return str(error)
    finally:
        session.close()
    return None if isinstance(info, dict) else f"GET {route} answered {excerpt(str(info), 100)}, not an object"


def url_engine_config(config: RunConfig, url: str, kind: str) -> dict[str, Any]:
    """The run's config with its rollout engine pointed at `url`. The run's own engine_options carry
    over when the run already drives a `kind` server by URL (an API key, timeouts). What `auto` resolved to for the
    run is pinned, so the relay writes the same bus fields as every other rollout replica."""
    raw = config.model_dump(mode="json")
    by_url = config.rollout.engine == kind and "url" in config.rollout.engine_options
    options = config.rollout.engine_options if by_url else {}
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
        """Probe every server in the run; drop the ones that stopped answering; forget drained ones."""
        for engine in list(self.engines.values()):
            if engine.draining:
                if not self._beating(engine.id) and not self.controller.app_running(engine.key):
                    self._forget(engine)
                continue
            problem = probe(engine.url, engine.kind)
            engine.unanswered = 0 if problem is None else engine.unanswered + 1
            if engine.unanswered >= DEAD_AFTER_PROBES:
                self._drop(engine, f"its server stopped answering ({problem})")
            elif problem is None and (failed := self.controller.app_failure(engine.key)) is not None:
                # the server answers but the relay cannot start: e.g. it serves another model
                self._drop(engine, f"its relay could not start: {excerpt(failed, 500)}")

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
