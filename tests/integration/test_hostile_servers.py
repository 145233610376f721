"""What a broken or hostile inference server can do to rlx's HTTP clients, over real loopback HTTP:
a probe of a server that trickles its reply (1 byte every 2 s) ends at its wall-clock deadline and
the driver's poll never waits for it (N9); the URL adapters' calls stop at their timeout and their
byte cap, and JSON that is too deep or holds a 5000-digit number is a ServerError (N13)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlx.engines.generation import server_client
from rlx.engines.generation.server_client import ServerEngine, ServerError
from rlx.orchestration import url_engines
from tests.integration.test_url_engines import Deployments, Health

TRICKLE_S = 2.0
REPLIES = {
    "/deep": b"[" * 200_000 + b"]" * 200_000,
    "/bigint": b'{"weight_version": ' + b"7" * 5000 + b"}",
    "/big": b'{"text": "' + b"x" * 300_000 + b'"}',
}


class Hostile(BaseHTTPRequestHandler):
    """Answers 200 to everything; `/get_model_info` and `/trickle` send their body 1 byte every 2 s."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path in REPLIES:
            body = REPLIES[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        try:
            while not self.server.stopping.is_set():
                self.wfile.write(b" ")
                self.wfile.flush()
                self.server.stopping.wait(TRICKLE_S)
        except OSError:  # the client gave up
            pass

    def log_message(self, *args: object) -> None:
        """Silent."""


@pytest.fixture()
def hostile() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    httpd.daemon_threads = True
    httpd.stopping = threading.Event()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.stopping.set()
    httpd.shutdown()
    httpd.server_close()


def test_a_probe_of_a_trickling_server_returns_by_its_deadline(hostile):
    started = time.monotonic()
    problem = url_engines.probe(hostile, "sglang", timeout_s=3.0)
    took = time.monotonic() - started
    assert problem == "no complete answer within 3s" and took < 3.5, (problem, took)
    # the probe itself also gives up once past its deadline (its thread does not live on)
    started = time.monotonic()
    problem = url_engines.probe_once(hostile, "sglang", timeout_s=3.0)
    assert "reply not complete within the timeout" in problem and time.monotonic() - started < 3.0 + TRICKLE_S + 1


def test_the_drivers_poll_never_waits_and_a_late_probe_is_unanswered(hostile, tiny_path, tmp_path, monkeypatch):
    from tests.integration.test_colocate_loop import toy_config

    monkeypatch.setattr(url_engines, "PROBE_TIMEOUT_S", 3.0)
    engines = url_engines.UrlEngines(Deployments(toy_config(tiny_path, tmp_path, train__mode="async")), Health(),
                                     echo=lambda _: None)
    engine = url_engines.UrlEngine("url-1", hostile, "sglang", "rollout-url-1")
    engines.engines[engine.id] = engine
    polls = []

    def poll() -> None:
        started = time.monotonic()
        engines.observe()
        polls.append(time.monotonic() - started)

    poll()  # starts the probe
    time.sleep(3.3)  # past its deadline; its next byte comes at 4 s
    poll()
    assert engine.unanswered == 1 and not engine.probing.done()  # late: unanswered, and not probed twice
    while engines.engines and len(polls) < 40:
        time.sleep(0.5)
        poll()
    assert max(polls) < 0.5, polls  # the poll starts probes and reads answers, it never waits on a server
    assert engines.engines == {} and engines.health.retired == ["url-1"]
    assert "stopped answering" in engines.events[-1]["reason"]


class Client(ServerEngine):
    """The real HTTP side of the URL adapters; this engine generates nothing."""

    def _generate_one(self, request, params):
        raise NotImplementedError


def test_an_adapters_call_stops_at_its_timeout_and_its_byte_cap(hostile, monkeypatch):
    client = Client(hostile, timeout_s=3.0, max_concurrency=1, api_key=None)
    started = time.monotonic()
    with pytest.raises(ServerError, match=r"/trickle failed \(HTTP 200\): reply not complete within the timeout"):
        client._call("GET", "/trickle")
    assert time.monotonic() - started < 3.0 + TRICKLE_S + 1
    monkeypatch.setattr(server_client, "MAX_REPLY_BYTES", 100_000)
    with pytest.raises(ServerError, match=r"/big failed \(HTTP 200\): reply over 100000 bytes"):
        client._call("GET", "/big")


@pytest.mark.parametrize(("route", "why"), [("/deep", "RecursionError"), ("/bigint", "ValueError")])
def test_json_rlx_will_not_read_is_a_server_error(hostile, route, why):
    with pytest.raises(ServerError, match=rf"{route} failed \(HTTP 200\): reply is JSON rlx will not read \({why}"):
        Client(hostile, timeout_s=10.0, max_concurrency=1, api_key=None)._call("GET", route)
