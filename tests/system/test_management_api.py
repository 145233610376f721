"""The management API over real HTTP on loopback: the app alone in front of a small stand-in for the
run (its guards: token, Host, body size, concurrency, strict bodies, scale refusals) and a
schema-driven fuzz (schemathesis) that must never get a 5xx. Against a live async run (auth,
scaling, checkpoint, a fuzz without the token, stop) it is driven by `scale_and_guard`, which
tests/system/test_url_engines.py runs before it adds a server by URL to the same run."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings

from rlx import cli, http_guard
from rlx.http_guard import MAX_CONNECTIONS, MAX_HEAD_BYTES
from rlx.orchestration.api import (
    MAX_BODY_BYTES,
    ApiServer,
    EngineRejected,
    ScaleRefused,
    ScaleTimedOut,
    UnknownEngine,
)

ROUTES = [("GET", "/v1/status"), ("GET", "/v1/rollout/engines"), ("POST", "/v1/rollout/scale"),
          ("POST", "/v1/rollout/engines"), ("DELETE", "/v1/rollout/engines/url-1"),
          ("POST", "/v1/checkpoint"), ("POST", "/v1/stop"), ("GET", "/docs"), ("GET", "/openapi.json"),
          ("GET", "/no/such/route")]


class StandIn:
    """A RunControl with a replica count and a checkpoint path, in place of a whole run. Its faults are
    injected on purpose: `capacity` (a larger scale is refused as a cluster would), `slow_from` (a
    scale to that many times out), and `gate` (status waits on it, to hold requests in flight)."""

    def __init__(self) -> None:
        self.replicas, self.capacity, self.slow_from = 1, 4, 3
        self.stopped, self.gate, self.waiting = False, threading.Event(), 0
        self.gate.set()

    def status(self) -> dict[str, Any]:
        self.waiting += 1
        self.gate.wait(30)
        self.waiting -= 1
        return {"step": 1}

    def engines(self) -> list[dict[str, Any]]:
        return [{"replica": f"r{i}"} for i in range(self.replicas)]

    def scale(self, replicas: int) -> dict[str, Any]:
        if replicas > self.capacity:
            raise ScaleRefused(f"{replicas - self.replicas} more rollout replica(s) need 1 CPU each; 0 CPU free")
        if replicas >= self.slow_from:
            raise ScaleTimedOut(f"rlx-rollout: {replicas} replica(s) did not all start within 1s")
        before, self.replicas = self.replicas, replicas
        return {"replicas_before": before, "replicas": replicas}

    def add_engine(self, url: str, engine: str) -> dict[str, Any]:
        raise EngineRejected(f"url={url}: no SGLang-compatible server answered; start the server first")

    def remove_engine(self, engine_id: str) -> dict[str, Any]:
        raise UnknownEngine(f"no rollout engine added by URL has id {engine_id!r}")

    def checkpoint(self) -> str:
        return "/tmp/checkpoint"

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture()
def api(tmp_path):
    control = StandIn()
    server = ApiServer(control, tmp_path, max_concurrent=2).start()
    yield server, control, {"Authorization": f"Bearer {server.token}"}
    control.gate.set()
    server.stop()


def raw(server: ApiServer, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send bytes as they are (headers requests would refuse to build); the status and the body back."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + b"\r\n" + body)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < content_length(reply):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), rest.split(b"\r\n\r\n", 1)[1]


def content_length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_every_route_and_the_docs_need_the_token(api):
    server, control, auth = api
    for method, path in ROUTES:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": server.token}):
            response = requests.request(method, server.url + path, headers=headers, json={"replicas": 2}, timeout=10)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert "api_token" in response.json()["detail"]
    assert control.replicas == 1 and not control.stopped
    assert requests.get(server.url + "/docs", headers=auth, timeout=10).status_code == 200
    schema = requests.get(server.url + "/openapi.json", headers=auth, timeout=10).json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_a_non_ascii_token_is_401_not_500(api):
    server, _, _ = api
    for token in ("Bearer \u00e9t\u00e9".encode("latin-1"), "Bearer \u00e9t\u00e9".encode(), b"Bearer \xff\x00"[:-1]):
        status, body = raw(server, b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + token
                           + b"\r\nConnection: close\r\n")
        assert status == 401, body


def test_the_token_is_checked_before_the_body_is_read(api):
    server, _, auth = api
    # a body announced but never sent: the answer comes from the headers alone, or this would hang
    head = b"POST /v1/rollout/scale HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50\r\nConnection: close\r\n"
    assert raw(server, head)[0] == 401
    too_big = (f"POST /v1/rollout/scale HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n"
               f"{'Authorization: ' + auth['Authorization']}\r\nConnection: close\r\n").encode()
    assert raw(server, too_big)[0] == 413


def test_a_body_over_the_limit_is_413_even_without_a_length(api):
    server, _, auth = api
    chunks = (b"x" * 4096 for _ in range(MAX_BODY_BYTES // 4096 + 2))  # chunked: no Content-Length
    response = requests.post(server.url + "/v1/rollout/scale", data=chunks, headers=auth, timeout=10)
    assert response.status_code == 413 and str(MAX_BODY_BYTES) in response.json()["detail"]
    assert requests.post(server.url + "/v1/rollout/scale", json={"replicas": 2}, headers=auth,
                         timeout=10).json() == {"replicas_before": 1, "replicas": 2}


def test_a_request_whose_client_leaves_mid_body_never_runs(api):
    server, control, auth = api
    head = (f"POST /v1/stop HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 40\r\n"
            f"Authorization: {auth['Authorization']}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + b"{}")  # 2 of the 40 bytes announced, then the client is gone
    time.sleep(1.0)
    assert not control.stopped


def test_a_foreign_host_header_is_refused(api):
    server, _, auth = api
    for host, expected in (("evil.example", 421), (f"evil.example:{server.port}", 421), ("127.0.0.2", 421),
                           (f"localhost:{server.port}", 200), (f"127.0.0.1:{server.port}", 200), ("LOCALHOST", 200)):
        response = requests.get(server.url + "/v1/rollout/engines", headers={**auth, "Host": host}, timeout=10)
        assert response.status_code == expected, (host, response.text)
    status, _ = raw(server, b"GET /v1/status HTTP/1.0\r\nAuthorization: " + auth["Authorization"].encode() + b"\r\n")
    assert status == 421  # no Host header at all


def test_a_websocket_upgrade_is_refused_even_with_the_token(api):
    server, _, auth = api
    status, _ = raw(server, b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                            b"Sec-WebSocket-Version: 13\r\nAuthorization: " + auth["Authorization"].encode() + b"\r\n")
    assert status == 403


def test_requests_beyond_the_concurrency_limit_get_429(api):
    server, control, auth = api
    control.gate.clear()
    held = [threading.Thread(target=requests.get, args=(server.url + "/v1/status",),
                             kwargs={"headers": auth, "timeout": 30}) for _ in range(2)]
    for thread in held:
        thread.start()
    deadline = time.monotonic() + 10
    while control.waiting < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert control.waiting == 2
    refused = requests.get(server.url + "/v1/rollout/engines", headers=auth, timeout=10)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    control.gate.set()
    for thread in held:
        thread.join(10)
    assert requests.get(server.url + "/v1/rollout/engines", headers=auth, timeout=10).status_code == 200


def closed(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closed this connection (it reads end-of-file) within `within_s`."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_are_bounded_and_closed_and_the_token_holder_is_served(tmp_path, monkeypatch):
    monkeypatch.setattr(http_guard, "HEAD_TIMEOUT_S", 1.5)
    server = ApiServer(StandIn(), tmp_path).start()
    auth = {"Authorization": f"Bearer {server.token}"}
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        held = [c for c in psutil.Process().net_connections("tcp")
                if c.laddr.port == server.port and c.status == psutil.CONN_ESTABLISHED]
        assert len(held) <= MAX_CONNECTIONS  # the server's side: the process's descriptors stay bounded
        assert closed(idle[0], 1.0)  # the oldest idle ones made room
        # a request on a fresh connection is served at once, the idle ones notwithstanding
        assert requests.get(server.url + "/v1/status", headers=auth, timeout=10).json() == {"step": 1}
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        slow.sendall(b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head that never ends
        assert closed(slow, 3.0) and all(closed(c, 3.0) for c in idle[-MAX_CONNECTIONS // 2:])
        huge = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        huge.sendall(b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * (2 * MAX_HEAD_BYTES))
        assert huge.recv(100).startswith(b"HTTP/1.1 4") or closed(huge, 1.0)  # an over-long head is refused
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_the_api_port_is_bound_when_the_server_is_made(tmp_path):
    server = ApiServer(StandIn(), tmp_path)  # not started yet: nothing else can take its port meanwhile
    try:
        with pytest.raises(OSError), socket.socket() as other:
            other.bind(("127.0.0.1", server.port))
    finally:
        server.serving.socket.close()


def test_the_cli_reaches_a_live_api_without_a_proxy_and_errs_cleanly_once_it_is_gone(tmp_path, monkeypatch, capsys):
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):  # a proxy that would see the token (nothing listens)
        monkeypatch.setenv(name, f"http://127.0.0.1:{http_guard.free_port()}")
    control = StandIn()
    server = ApiServer(control, tmp_path).start()
    assert not list(tmp_path.glob(".api.json*"))  # written whole, nothing staged left behind
    try:
        assert cli.main(["status", str(tmp_path)]) == 0 and json.loads(capsys.readouterr().out) == {"step": 1}
        assert cli.main(["scale", str(tmp_path), "9"]) == 1  # refused (409): the exit status says so
        assert "need 1 CPU each" in capsys.readouterr().out and control.replicas == 1
    finally:
        server.stop()
    assert not (tmp_path / "api.json").exists() and not (tmp_path / "api_token").exists()
    assert cli.main(["status", str(tmp_path)]) == 2
    assert "no readable api.json" in capsys.readouterr().err
    (tmp_path / "api.json").write_text(json.dumps({"url": f"http://127.0.0.1:{http_guard.free_port()}"}))
    (tmp_path / "api_token").write_text("stale")
    assert cli.main(["status", str(tmp_path)]) == 2  # a stale file from a run killed hard: no traceback
    assert "does not answer (ConnectionError): has the run ended?" in capsys.readouterr().err


@pytest.mark.parametrize("body", [{"replicas": True}, {"replicas": "2"}, {"replicas": 2.0}, {"replicas": 2, "force": 1},
                                  {"replicas": 0}, {"replicas": 17}, {}, [2]])
def test_scale_bodies_are_strict(api, body):
    server, control, auth = api
    response = requests.post(server.url + "/v1/rollout/scale", json=body, headers=auth, timeout=10)
    assert response.status_code == 422, response.text
    assert control.replicas == 1


def test_a_scale_the_cluster_cannot_place_or_finish_is_refused_with_the_reason(api):
    server, control, auth = api
    refused = requests.post(server.url + "/v1/rollout/scale", json={"replicas": 5}, headers=auth, timeout=10)
    assert refused.status_code == 409 and "need 1 CPU each; 0 CPU free" in refused.json()["detail"]
    late = requests.post(server.url + "/v1/rollout/scale", json={"replicas": 3}, headers=auth, timeout=10)
    assert late.status_code == 504 and "did not all start within 1s" in late.json()["detail"]
    assert control.replicas == 1


def test_fuzzing_with_the_token_never_gets_a_server_error(api):
    server, _, auth = api
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=auth)

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=schema.as_strategy())
    def no_server_errors(case):
        response = case.call(base_url=server.url, headers=auth)
        assert response.status_code < 500 or response.status_code == 504, (case.method, case.path, response.text)

    no_server_errors()


def wait_for(predicate, timeout: float = 300.0, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (OSError, ValueError, requests.RequestException):  # the run is still starting
            value = None
        if value:
            return value
        time.sleep(every)
    raise TimeoutError("condition not met in time")


def stop_run(run_dir: Path) -> None:
    """End a run through its management API, as a test's driver thread does when it is done or failed."""
    url = wait_for(lambda: json.loads((run_dir / "api.json").read_text())["url"])
    token = (run_dir / "api_token").read_text()
    requests.post(f"{url}/v1/stop", headers={"Authorization": f"Bearer {token}"}, timeout=30)


def fuzz_without_token(url: str, auth: dict[str, str]) -> None:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=auth)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=schema.as_strategy())
    def no_server_errors(case):
        response = case.call(base_url=url)
        assert response.status_code < 500, (case.method, case.path, response.text)
        assert response.status_code == 401, (case.method, case.path, response.status_code)  # nothing gets through

    no_server_errors()


def scale_and_guard(url: str, auth: dict[str, str], seen: dict) -> None:
    """Against a live run: mutations without the token or with a bad body are refused, the rollout
    scales out to 2 replicas and back to 1 while it trains, a checkpoint is written on request, and
    a fuzz without the token gets nothing through. What it saw goes into `seen`
    (tests/system/test_url_engines.py drives a run through this and then adds a server by URL)."""
    status = lambda: requests.get(f"{url}/v1/status", headers=auth, timeout=30).json()
    engines = lambda: requests.get(f"{url}/v1/rollout/engines", headers=auth, timeout=30).json()
    seen["no_token"] = requests.post(f"{url}/v1/rollout/scale", json={"replicas": 2}, timeout=30).status_code
    seen["wrong_token"] = requests.post(f"{url}/v1/rollout/scale", json={"replicas": 2}, timeout=30,
                                        headers={"Authorization": "Bearer nope"}).status_code
    seen["bad_body"] = requests.post(f"{url}/v1/rollout/scale", json={"replicas": 0}, headers=auth,
                                     timeout=30).status_code
    seen["replica_before_up"] = engines()[0]["replica"]
    seen["up"] = requests.post(f"{url}/v1/rollout/scale", json={"replicas": 2}, headers=auth, timeout=600).json()
    seen["step_at_2"] = status()["step"]
    seen["engines_at_2"] = wait_for(lambda: len(engines()) == 2 and engines())
    wait_for(lambda: status()["step"] >= seen["step_at_2"] + 3)
    seen["down"] = requests.post(f"{url}/v1/rollout/scale", json={"replicas": 1}, headers=auth, timeout=600).json()
    seen["step_at_1"] = status()["step"]
    wait_for(lambda: len(engines()) == 1)
    seen["checkpoint"] = requests.post(f"{url}/v1/checkpoint", headers=auth, timeout=600).json()["path"]
    fuzz_without_token(url, auth)


def check_scaled_and_guarded(seen: dict, steps: list[dict]) -> None:
    """What `scale_and_guard` must have seen, and the run's steps around it."""
    assert seen["no_token"] == 401 and seen["wrong_token"] == 401 and seen["bad_body"] == 422
    assert seen["up"] == {"replicas_before": 1, "replicas": 2}
    assert len({e["replica"] for e in seen["engines_at_2"]}) == 2
    # scaling out adds a replica beside the running one: it is not restarted
    assert seen["replica_before_up"] in {e["replica"] for e in seen["engines_at_2"]}
    assert seen["down"] == {"replicas_before": 2, "replicas": 1}
    assert Path(seen["checkpoint"], "model.safetensors").exists()
    assert steps[-1]["total_samples_duplicated"] == 0  # scale-in and scale-out lost and repeated nothing
    rate = lambda a, b: (b - a) * 16 / (steps[b - 1]["wall_time_s"] - steps[a - 1]["wall_time_s"])
    print(f"samples/s with 1 replica: {rate(1, seen['step_at_2']):.2f}; "
          f"with 2: {rate(seen['step_at_2'], seen['step_at_1']):.2f}")
