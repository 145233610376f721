"""Alerts reach a real JSON webhook on loopback (Apprise's json:// URL)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from rlx.config import ConfigError
from rlx.obs import Alerts
from rlx.orchestration.colocate import run_colocate
from tests.integration.test_colocate_loop import toy_config


@pytest.fixture()
def webhook():
    received: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"json://127.0.0.1:{server.server_port}/hook", received
    server.shutdown()


def test_a_finished_run_notifies(tiny_path, tmp_path, webhook):
    url, received = webhook
    config = toy_config(tiny_path, tmp_path, train__steps=2)
    config.logging.alerts = [url]
    run_colocate(config, echo=lambda _: None)
    assert [m["title"] for m in received] == ["rlx run: finished"]
    assert "2 steps" in received[0]["message"] and received[0]["type"] == "success"


def test_a_failed_run_notifies_and_still_fails(tiny_path, tmp_path, webhook):
    url, received = webhook
    config = toy_config(tiny_path, tmp_path, train__steps=2)
    config.logging.alerts = [url]
    config.model.path = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError):
        run_colocate(config, echo=lambda _: None)
    assert [m["type"] for m in received] == ["failure"] and "no-such-model" in received[0]["message"]


def test_an_unusable_alert_url_is_a_config_error():
    with pytest.raises(ConfigError, match="logging.alerts"):
        Alerts(["definitely not a url"], "run")
