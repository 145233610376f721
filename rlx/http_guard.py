"""HTTP hardening shared by rlx's loopback servers (the management API, the agent-app endpoint).

`Guard` is ASGI middleware that answers before any body is read: a Host header other than this
machine's names is 421 (DNS rebinding), a missing or wrong bearer token 401, more than
`max_concurrent` requests at once 429; a body over `max_body_bytes` is 413. `ServerThread` runs
an app with uvicorn on a daemon thread, beside the process's own work. It lives at the bottom
layer so any server, whatever its layer, can use it without importing another layer.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
TOKEN_HINT = "it is in <run_dir>/api_token"  # where the management API's token is written

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

GONE = b"<the client disconnected>"  # compared by identity: no real body is this object


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a request header (ASGI names are lower-case bytes)."""
    return next((value for key, value in scope["headers"] if key == name), None)


def host_name(value: bytes | None) -> str | None:
    """The host part of a Host header, lower-cased: `[::1]:80` -> `::1`, `Localhost:8` -> `localhost`."""
    if not value:
        return None
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else None
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class Guard:
    """ASGI middleware in front of the whole app, so no route (nor /docs) can be reached past it.
    Host, token and concurrency are checked from the headers alone; the body is then read up to
    the limit and handed on. `token_hint` tells a 401's reader where the token comes from."""

    def __init__(self, app: Asgi, token: str, hosts: frozenset[str], max_body_bytes: int,
                 max_concurrent: int, token_hint: str = TOKEN_HINT) -> None:
        self.app, self.token, self.hosts, self.token_hint = app, token.encode("ascii"), hosts, token_hint
        self.max_body_bytes, self.max_concurrent = max_body_bytes, max_concurrent
        self.active = 0  # requests past the checks; only the event loop's thread touches it

    def authorized(self, scope: Scope) -> bool:
        """Compared as bytes: a token with non-ASCII bytes is simply wrong, not an error."""
        value = header(scope, b"authorization") or b""
        scheme, _, credentials = value.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(credentials.strip(), self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no route takes a websocket: refused before the app sees it
            await send({"type": "websocket.close", "code": 1008})
            return
        if host_name(header(scope, b"host")) not in self.hosts:
            await reply(send, 421, f"Host must be one of {sorted(self.hosts)} (this server serves this machine only)")
            return
        if not self.authorized(scope):
            await reply(send, 401, f"missing or wrong bearer token ({self.token_hint})",
                        [(b"www-authenticate", b"Bearer")])
            return
        if self.active >= self.max_concurrent:
            await reply(send, 429, f"more than {self.max_concurrent} requests at once; retry shortly",
                        [(b"retry-after", b"1")])
            return
        self.active += 1
        try:
            body = await self.read_body(scope, receive)
            if body is None:
                await reply(send, 413, f"request body over {self.max_body_bytes} bytes")
                return
            if body is GONE:  # the client left mid-body: an aborted request never runs
                return
            await self.app(scope, replay(body, receive), send)
        finally:
            self.active -= 1

    async def read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body; None once it is over the limit (by Content-Length, or by what arrives);
        `GONE` if the client disconnected before sending all of it."""
        declared = header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return GONE
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the app the body already read, then waits on the client as usual."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return again


async def reply(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A JSON `{"detail": ...}` answer sent from the guard, the app never reached."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerThread:
    """`app` served by uvicorn on a daemon thread; `what` names the server in start-up errors."""

    def __init__(self, app: Asgi, host: str, port: int, what: str, thread_name: str) -> None:
        self.url, self.what = f"http://{host}:{port}", what
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name=thread_name, daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        """Returns once the server accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.what} did not start on {self.url}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
