"""The sglang client against a server it should not trust blindly, over real HTTP on loopback.

`ScriptedServer` answers SGLang's routes with replies set by the test: a fault-injection stand-in
for a broken or hostile server (the loopback imitation in tests/support always answers correctly).
`RecordingProxy` is where HTTP_PROXY points: it counts what reaches it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.sglang import SGLangEngine, SGLangError

REQUEST = GenerationRequest(request_id=1, prompt_ids=[3, 4])


class Recorder(BaseHTTPRequestHandler):
    """Records (method, path, Authorization) and answers from `server.replies[path]` (502 if none)."""

    def answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.server.seen.append((self.command, self.path, self.headers.get("Authorization")))
        body = self.server.replies.get(self.path)
        status, text = (200, body) if body is not None else (502, "not here")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(text.encode())))
        self.end_headers()
        self.wfile.write(text.encode())

    do_GET = do_POST = answer

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass


def serve(replies: dict[str, str]) -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.seen, server.replies = [], replies
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def generate_reply(entries: str) -> str:
    """A /generate reply with `entries` as raw JSON text (so NaN and Infinity go out as Python's json writes them)."""
    return ('{"text": "x", "meta_info": {"id": "r", "finish_reason": {"type": "stop"}, "weight_version": "0", '
            f'"output_token_logprobs": {entries}}}}}')


@pytest.fixture()
def scripted():
    yield from serve({"/get_model_info": json.dumps({"weight_version": "0"}),
                      "/generate": generate_reply('[[-0.5, 7, "a"]]')})


@pytest.fixture()
def proxy(monkeypatch):
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for recording in serve({}):
        address = f"http://127.0.0.1:{recording.server_address[1]}"
        for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"):
            monkeypatch.setenv(name, address)
        yield recording


def url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_loopback_calls_skip_the_proxy_and_carry_the_api_key(scripted, proxy):
    requests.get(url(scripted) + "/get_model_info", timeout=10)  # a plain client obeys HTTP_PROXY ...
    assert [path for _, path, _ in proxy.seen] == [url(scripted) + "/get_model_info"]
    engine = SGLangEngine(url(scripted), timeout_s=10, api_key="sk-test", vocab_size=50)  # ... this one does not
    results = list(engine.stream([REQUEST], SamplingParams()))
    assert results[0].response_ids == [7] and results[0].logprobs == [-0.5]
    assert len(proxy.seen) == 1
    assert [(m, p) for m, p, _ in scripted.seen] == [("GET", "/get_model_info"), ("POST", "/generate")]
    assert {auth for _, _, auth in scripted.seen} == {"Bearer sk-test"}


def test_without_a_key_no_authorization_header_is_sent(scripted):
    SGLangEngine(url(scripted), timeout_s=10)
    assert scripted.seen == [("GET", "/get_model_info", None)]


@pytest.mark.parametrize("entries, field", [
    ('[[-0.5, 7, "a"], [-0.1, 50, "b"]]', "token id 50 is outside the vocabulary [0, 50)"),
    ('[[NaN, 7, "a"]]', "log-prob nan of token 7 is not a finite number <= 0"),
    ('[[-Infinity, 7, "a"]]', "log-prob -inf of token 7"),
])
def test_a_server_sending_unusable_tokens_is_named_with_the_field(scripted, entries, field):
    scripted.replies["/generate"] = generate_reply(entries)
    engine = SGLangEngine(url(scripted), timeout_s=10, vocab_size=50)
    with pytest.raises(SGLangError) as caught:
        list(engine.stream([REQUEST], SamplingParams()))
    assert str(caught.value).startswith(f"SGLang {url(scripted)}/generate failed (HTTP 200): malformed reply")
    assert f"output_token_logprobs {field}" in str(caught.value)
