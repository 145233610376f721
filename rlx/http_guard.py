"""HTTP hardening shared by rlx's loopback servers (the management API, the agent-app endpoint).

`Guard` is ASGI middleware that answers before any body is read: a Host header other than this
machine's names is 421 (DNS rebinding), a missing or wrong bearer token 401, more than
`max_concurrent` requests at once 429; a body over `max_body_bytes` is 413. `ServerThread` runs
an app with uvicorn on a daemon thread, beside the process's own work, on a socket it binds itself
(the port is never picked first and bound later). It lives at the bottom layer so any server,
whatever its layer, can use it without importing another layer.

Connections are bounded before any request reaches the Guard (which acts per request): at most
`MAX_CONNECTIONS` at once, a new one over that closing the oldest that has not started a request;
a connection that has not sent a whole request head within `HEAD_TIMEOUT_S`, or stays idle
`KEEP_ALIVE_S` after a response, is closed; a request head is at most `MAX_HEAD_BYTES`. So idle
connections from other local users cannot use up the process's file descriptors (its metrics and
checkpoints need them), and a request that starts on a fresh connection is served.
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
from uvicorn.protocols.http.h11_impl import H11Protocol

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
TOKEN_HINT = "it is in <run_dir>/api_token"  # where the management API's token is written

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

GONE = b"<the client disconnected>"  # compared by identity: no real body is this object
MAX_CONNECTIONS = 64
HEAD_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5
MAX_HEAD_BYTES = 8192


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
    """A port nothing listens on now (tests use it for an address where no server answers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class BoundedH11(H11Protocol):
    """uvicorn's h11 connection with the bounds above (uvicorn itself has no timer before a first
    request and no cap on open connections)."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.opened_at, self.head_timer = time.monotonic(), None
        self._await_head()
        if len(self.connections) > MAX_CONNECTIONS:  # the oldest idle one goes (this one, if no other is idle)
            idle = [c for c in self.connections if isinstance(c, BoundedH11) and c.idle()]
            oldest = min(idle, key=lambda c: c.opened_at)
            oldest.transport.close()
            self.connections.discard(oldest)  # uncounted now: its connection_lost comes a loop turn later

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.idle():
            self._await_head()
        elif self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)

    def idle(self) -> bool:
        """No request in progress: none yet, or the last one answered."""
        return self.cycle is None or self.cycle.response_complete

    def _await_head(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

    def _head_late(self) -> None:
        self.head_timer = None
        if self.idle():
            self.transport.close()


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host` (`port=0`: a free port), bound now so no other process can
    take the port between choosing and serving it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=MAX_CONNECTIONS)


class ServerThread:
    """`app` served by uvicorn on a daemon thread; `what` names the server in start-up errors.
    `port=0`: a free port, bound at once (`self.port` says which)."""

    def __init__(self, app: Asgi, host: str, port: int, what: str, thread_name: str) -> None:
        self.socket = bound_socket(host, port)
        self.port = self.socket.getsockname()[1]
        self.url, self.what = f"http://{host}:{self.port}", what
        self.server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=self.port, log_level="warning", http=BoundedH11,
            limit_concurrency=MAX_CONNECTIONS + 1,  # BoundedH11 caps connections; uvicorn's 503 never comes first
            timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEAD_BYTES))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, name=thread_name,
                                       daemon=True)

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
        self.socket.close()
