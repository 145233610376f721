"""Rollout engines added by URL, without a run: the registry and the API routes over real HTTP on
loopback, against rlx's SGLang-compatible test server (tests/support). `Deployments` stands in for
the Controller's Serve side (it records what would be deployed or deleted, and plays the relay's
heartbeats and Serve's deploy failure), so each case runs in seconds; the live run, with real
Serve relays, is tests/system/test_url_engines.py."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import Any

import pytest
import requests

from rlx.http_guard import free_port
from rlx.orchestration.api import ApiServer, EngineConflict, EngineRejected, UnknownEngine
from rlx.orchestration.url_engines import DEAD_AFTER_PROBES, UrlEngines, normalize_url, url_engine_config
from tests.integration.test_colocate_loop import toy_config
from tests.support.sglang_server import LoopbackServer


class Board:
    """The heartbeat board's phases, as the Controller's HeartbeatsClient shows them."""

    def __init__(self) -> None:
        self.board: dict[str, str] = {}

    def phases(self) -> dict[str, str]:
        return dict(self.board)

    def clear_phase(self, engine_id: str) -> None:
        self.board.pop(engine_id, None)


class Deployments:
    """The Controller's side of URL engines, recorded instead of deployed on Serve."""

    def __init__(self, config) -> None:
        self.config, self.heartbeats = config, Board()
        self.deployed: dict[str, dict[str, Any]] = {}
        self.removed: list[str] = []
        self.failed: dict[str, str] = {}  # key -> Serve's DEPLOY_FAILED message (injected)

    def deploy_url_engine(self, engine_id: str, config: dict[str, Any]) -> str:
        key = f"rollout-{engine_id}"
        self.deployed[key] = config
        return key

    def remove_app(self, key: str) -> None:
        self.removed.append(key)

    def app_running(self, key: str) -> bool:
        return key in self.deployed and key not in self.removed

    def app_failure(self, key: str) -> str | None:
        return self.failed.get(key)


class Health:
    """The HealthManager's view: live beats, and which engines were retired."""

    def __init__(self) -> None:
        self.live: dict[str, dict[str, Any]] = {}
        self.retired: list[str] = []

    def retire_engine(self, engine_id: str) -> tuple[int, int]:
        self.retired.append(engine_id)
        self.live = {r: b for r, b in self.live.items() if b["status"].get("engine_id") != engine_id}
        return 0, 2


@pytest.fixture(scope="module")
def server(tiny_path):
    with LoopbackServer(tiny_path, max_batch_size=4) as running:
        yield running


@pytest.fixture()
def engines(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, train__mode="async", train__max_staleness=1)
    return UrlEngines(Deployments(config), Health(), echo=lambda _: None)


class NotSGLang(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "9")
        self.end_headers()
        self.wfile.write(b"not found")

    def log_message(self, *args: object) -> None:
        """Silent: the base class would print every request to stderr."""


@pytest.fixture()
def not_sglang():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotSGLang)
    Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_urls_are_normalized_and_bad_ones_named():
    assert normalize_url("HTTP://LocalHost:30000/") == "http://localhost:30000"
    assert normalize_url("https://10.0.0.5") == "https://10.0.0.5:443"
    assert normalize_url("http://[::1]:8000") == "http://[::1]:8000"
    for bad in ("127.0.0.1:30000", "ftp://127.0.0.1:1", "http://127.0.0.1:30000/v1", "http://u:p@127.0.0.1:1",
                "http://127.0.0.1:99999", "http://127.0.0.1:1/?x=1", ""):
        with pytest.raises(EngineRejected, match=r"url=.*give http\(s\)://host:port"):
            normalize_url(bad)


def test_the_relay_config_points_the_engine_at_the_server_and_pins_what_auto_resolved(engines):
    run = engines.controller.config
    raw = url_engine_config(run, "http://127.0.0.1:1234", "sglang")
    assert raw["rollout"]["engine"] == "sglang" and raw["rollout"]["engine_options"] == {"url": "http://127.0.0.1:1234"}
    assert raw["algorithm"]["behavior_correction"] == run.algorithm.resolved_correction == "decoupled"
    assert raw["algorithm"]["routing_replay"] == run.routing_replay
    same = run.model_copy(update={"rollout": run.rollout.model_copy(update={
        "engine": "sglang", "engine_options": {"url": "http://127.0.0.1:1", "timeout_s": 30, "api_key": "run-key"}})})
    # the run's own server's key stays with that server (N15)
    assert url_engine_config(same, "http://127.0.0.1:2", "sglang")["rollout"]["engine_options"] == {
        "url": "http://127.0.0.1:2", "timeout_s": 30}
    # an in-process vllm run's engine arguments are not options of the vllm URL adapter
    in_process = run.model_copy(update={"rollout": run.rollout.model_copy(update={
        "engine": "vllm", "engine_options": {"max_model_len": 256}})})
    assert url_engine_config(in_process, "http://127.0.0.1:2", "vllm")["rollout"]["engine_options"] == {
        "url": "http://127.0.0.1:2"}


def test_bad_engines_are_refused_naming_the_field_and_the_fix(engines, server, not_sglang):
    with pytest.raises(EngineRejected, match=r"engine='hf' cannot be added by URL.*sglang, vllm"):
        engines.add(server.url, "hf")
    replaying = engines.controller.config.model_copy(update={"algorithm": engines.controller.config.algorithm.model_copy(
        update={"routing_replay": "r3"})})
    with pytest.raises(EngineRejected, match=r"engine='vllm' cannot be added to this run: it replays"):
        UrlEngines(Deployments(replaying), Health(), echo=lambda _: None).add(server.url, "vllm")
    with pytest.raises(EngineRejected, match=r"url=http://127.0.0.1:\d+: no sglang server answered "
                                             r"GET /get_model_info \(ConnectionError.*start the server first"):
        engines.add(f"http://127.0.0.1:{free_port()}", "sglang")
    # an SGLang server is not a vLLM server with its RL API on
    with pytest.raises(EngineRejected, match=r"no vllm server answered GET /weight_info \(.*HTTP 404.*"
                                             r"VLLM_SERVER_DEV_MODE=1"):
        engines.add(server.url, "vllm")
    with pytest.raises(EngineRejected, match=r"HTTP 404"):
        engines.add(not_sglang, "sglang")
    assert engines.controller.deployed == {} and engines.listing() == []


def test_an_engine_is_added_once_listed_by_state_and_removed_by_draining(engines, server):
    added = engines.add(server.url + "/", "sglang")
    assert added == {"id": "url-1", "url": server.url, "engine": "sglang", "state": "pending"}
    (config,) = engines.controller.deployed.values()
    assert config["rollout"]["engine_options"]["url"] == server.url
    with pytest.raises(EngineConflict, match=r"already a rollout engine of this run"):
        engines.add(server.url.replace("http", "HTTP"), "sglang")  # the same server
    engines.controller.heartbeats.board["url-1"] = "loading"
    assert engines.listing()[0]["state"] == "loading"
    engines.health.live["rollout-abc"] = {"silent_s": 0.5, "status": {
        "engine_id": "url-1", "consumer": "rollout-abc", "state": "active", "weight_version": 3, "items": 8}}
    (active,) = engines.listing()
    assert active["state"] == "active" and active["weight_version"] == 3 and active["replica"] == "rollout-abc"
    engines.observe()  # the server answers: nothing changes
    assert engines.listing()[0]["state"] == "active"
    with pytest.raises(UnknownEngine, match=r"no rollout engine added by URL has id 'rollout-abc'.*GET /v1/rollout"):
        engines.remove("rollout-abc")
    assert engines.remove("url-1")["state"] == "draining"
    assert engines.remove("url-1")["state"] == "draining"  # asked twice: one removal
    assert engines.controller.removed == ["rollout-url-1"]
    assert engines.listing()[0]["state"] == "draining"
    engines.observe()  # still beating (finishing its groups): still listed
    assert [e["id"] for e in engines.listing()] == ["url-1"]
    engines.health.live.clear()  # it said goodbye
    engines.observe()
    assert engines.listing() == [] and [e["event"] for e in engines.events] == ["added", "removed"]
    assert engines.add(server.url, "sglang")["id"] == "url-2"  # the URL may come back


def test_an_engine_whose_server_stops_answering_is_dropped_and_its_groups_requeued(engines, tiny_path):
    server = LoopbackServer(tiny_path, max_batch_size=4).start()
    engines.add(server.url, "sglang")
    server.stop()
    engines.observe()  # starts the first probe; each later poll takes an answer and starts the next probe
    for _ in range(DEAD_AFTER_PROBES - 1):
        engines.probes_finished()
        engines.observe()
        assert engines.listing()[0]["state"] == "pending"  # one unanswered probe is not yet a death
    engines.probes_finished()
    engines.observe()
    assert engines.listing() == [] and engines.health.retired == ["url-1"]
    assert engines.controller.removed == ["rollout-url-1"]
    dropped = engines.events[-1]
    assert dropped["event"] == "dropped" and dropped["groups_requeued"] == 2
    assert "stopped answering (ConnectionError" in dropped["reason"]


def test_an_engine_whose_relay_cannot_start_is_dropped_with_serves_reason(engines, server):
    engines.add(server.url, "sglang")
    engines.controller.failed["rollout-url-1"] = "'lm_head.weight' is not a weight of /models/other"
    engines.observe()
    engines.probes_finished()
    engines.observe()
    assert engines.listing() == []
    assert "relay could not start: 'lm_head.weight' is not a weight" in engines.events[-1]["reason"]


class Control:
    """The RunControl's engine routes over a registry (the rest of a run is not needed here)."""

    def __init__(self, engines: UrlEngines) -> None:
        self.url_engines = engines

    def engines(self) -> list[dict[str, Any]]:
        return self.url_engines.listing()

    def add_engine(self, url: str, engine: str) -> dict[str, Any]:
        return self.url_engines.add(url, engine)

    def remove_engine(self, engine_id: str) -> dict[str, Any]:
        return self.url_engines.remove(engine_id)


def test_the_api_routes_answer_4xx_naming_the_field(engines, server, tmp_path):
    api = ApiServer(Control(engines), tmp_path).start()
    auth = {"Authorization": f"Bearer {api.token}"}
    url = f"{api.url}/v1/rollout/engines"
    try:
        post = lambda body: requests.post(url, json=body, headers=auth, timeout=30)
        assert requests.post(url, json={"url": server.url, "engine": "sglang"}, timeout=30).status_code == 401
        for body in ({"url": server.url}, {"engine": "sglang"}, {"url": server.url, "engine": "sglang", "x": 1},
                     {"url": 5, "engine": "sglang"}, {"url": "", "engine": "sglang"}):
            response = post(body)
            assert response.status_code == 422, (body, response.text)
        missing = post({"engine": "sglang"}).json()["detail"][0]
        assert missing["loc"] == ["body", "url"]
        refused = post({"url": server.url, "engine": "hf"})
        assert refused.status_code == 422 and refused.json()["detail"].startswith("engine='hf'")
        unreachable = post({"url": f"http://127.0.0.1:{free_port()}", "engine": "sglang"})
        assert unreachable.status_code == 422 and "start the server first" in unreachable.json()["detail"]
        added = post({"url": server.url, "engine": "sglang"})
        assert added.status_code == 202 and added.json()["state"] == "pending"
        again = post({"url": server.url, "engine": "sglang"})
        assert again.status_code == 409 and f"url={server.url} is already" in again.json()["detail"]
        assert [e["id"] for e in requests.get(url, headers=auth, timeout=30).json()] == ["url-1"]
        unknown = requests.delete(f"{url}/url-9", headers=auth, timeout=30)
        assert unknown.status_code == 404 and "'url-9'" in unknown.json()["detail"]
        removed = requests.delete(f"{url}/url-1", headers=auth, timeout=30)
        assert removed.status_code == 202 and removed.json()["state"] == "draining"
    finally:
        api.stop()


def test_the_health_manager_retires_a_dropped_engine_and_counts_no_restart_for_its_relay():
    """The real HealthManager, heartbeat board, bus and prompt source in-process (as in
    tests/unit/test_health.py); silence stands in for a dead relay."""
    from tests.unit.test_health import go_silent, put_group, setup

    bus, beats, prompts, health = setup()  # max_restarts_per_role=1
    relay = {"busy_fraction": 1.0, "engine_id": "url-1"}
    prompts.take(2, "rollout-u1", version=0)
    put_group(bus, 0, 1)
    beats.beat("rollout", "rollout-u1", relay)
    beats.beat("rollout", "rollout-s1", {"busy_fraction": 1.0})
    health.observe()
    assert health.retire_engine("url-1") == (0, 2)  # both groups unfinished: handed out again
    assert "rollout-u1" not in beats.snapshot() and set(health.live) == {"rollout-s1"}
    assert len(bus.index.rows) == 0 and prompts.state()["groups_requeued"] == 2
    beats.beat("rollout", "rollout-u1", relay)  # a beat sent just before the relay was killed
    assert health.observe() == [] and "rollout-u1" not in beats.snapshot()

    for relay_replica in ("rollout-u2", "rollout-u3"):  # relays of another engine die twice: no RoleFailed
        beats.beat("rollout", relay_replica, {"busy_fraction": 1.0, "engine_id": "url-2"})
        health.observe()
        go_silent(beats, relay_replica)
        [recovery] = health.observe()
        assert recovery.replica == relay_replica
    assert health.restarts["rollout"] == 0
