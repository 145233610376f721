"""The management API of a running async job (FastAPI on 127.0.0.1, OpenAPI at /openapi.json).

Every route, reads and the docs included, needs the bearer token generated for this run and
written, readable only by its owner, to `<run_dir>/api_token`. A guard in front of the app answers
before any body is read: a Host header other than this machine's names is 421 (DNS rebinding), a
missing or wrong token 401, more than `max_concurrent` requests at once 429; a body over
`max_body_bytes` is 413. One scale operation (the API's or the autoscaler's) runs at a time; a
second one gets 409, as does one the cluster cannot place; one that does not finish in time is 504.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, HTTPException, Security
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

MAX_ROLLOUT_REPLICAS = 16
MAX_BODY_BYTES = 64 * 1024  # the largest body any route takes is a few bytes of JSON
MAX_CONCURRENT = 8
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
TOKEN_HINT = "it is in <run_dir>/api_token"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


class ScaleInProgress(RuntimeError):
    """Another scale operation (an API call or the autoscaler) is still running."""


class ScaleRefused(RuntimeError):
    """The cluster cannot place what the scale asks for; the message says what is missing."""


class ScaleTimedOut(TimeoutError):
    """New replicas did not start in time; the scale was undone."""


class RunControl(Protocol):
    """What the API can see and do; the async controller implements it."""

    def status(self) -> dict[str, Any]: ...

    def engines(self) -> list[dict[str, Any]]: ...

    def scale(self, replicas: int) -> dict[str, Any]:
        """Raises ScaleInProgress while another scale operation runs, ScaleRefused when the cluster
        cannot place the replicas, ScaleTimedOut when they do not start in time."""

    def checkpoint(self) -> str: ...

    def stop(self) -> None: ...


class ScaleRequest(BaseModel):
    """Strict: `true` or `"2"` is not a count, and an unknown field is a mistake, not something to ignore."""

    model_config = ConfigDict(extra="forbid", strict=True)
    replicas: int = Field(ge=1, le=MAX_ROLLOUT_REPLICAS, description="target number of rollout replicas")


class ScaleResult(BaseModel):
    replicas_before: int
    replicas: int


class CheckpointResult(BaseModel):
    path: str


class Detail(BaseModel):
    detail: str


class Info(BaseModel):
    message: str


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
    the limit and handed on."""

    def __init__(self, app: Asgi, token: str, hosts: frozenset[str], max_body_bytes: int,
                 max_concurrent: int) -> None:
        self.app, self.token, self.hosts = app, token.encode("ascii"), hosts
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
            await reply(send, 421, f"Host must be one of {sorted(self.hosts)} (this API serves this machine only)")
            return
        if not self.authorized(scope):
            await reply(send, 401, f"missing or wrong bearer token ({TOKEN_HINT})",
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
            if body is GONE:  # the client left mid-body: an aborted stop or checkpoint never runs
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


GONE = b"<the client disconnected>"  # compared by identity: no real body is this object


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
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def build_api(control: RunControl, token: str, host: str = "127.0.0.1", max_body_bytes: int = MAX_BODY_BYTES,
              max_concurrent: int = MAX_CONCURRENT) -> Guard:
    """The app behind its guard; `host` (the bound address) is accepted in Host headers besides loopback."""
    # declares the bearer scheme in the OpenAPI document; the Guard is what enforces it
    app = FastAPI(title="rlx management API", version="1",
                  dependencies=[Security(HTTPBearer(auto_error=False, description=TOKEN_HINT))])
    errors = {401: {"model": Detail}, 413: {"model": Detail}, 421: {"model": Detail}, 429: {"model": Detail}}

    @app.get("/v1/status", responses=errors)
    def status() -> dict[str, Any]:
        """Step, roles with their replicas, recoveries, prompt and bus counters."""
        return control.status()

    @app.get("/v1/rollout/engines", responses=errors)
    def engines() -> list[dict[str, Any]]:
        """Every rollout replica: its id, weight version, samples produced, busy fraction."""
        return control.engines()

    @app.post("/v1/rollout/scale", response_model=ScaleResult,
              responses={**errors, 409: {"model": Detail}, 504: {"model": Detail}})
    def scale(request: ScaleRequest) -> ScaleResult:
        """New replicas load the latest weights before they generate; removed ones finish or hand back
        their groups. Refused (409) while another scale runs or when the cluster lacks the resources;
        504 when the new replicas do not start in time (the scale is undone)."""
        try:
            return ScaleResult(**control.scale(request.replicas))
        except ScaleInProgress as busy:
            raise HTTPException(409, f"{busy}; try again when it has finished") from busy
        except ScaleRefused as refused:
            raise HTTPException(409, str(refused)) from refused
        except ScaleTimedOut as late:
            raise HTTPException(504, str(late)) from late

    @app.post("/v1/checkpoint", response_model=CheckpointResult, responses=errors)
    def checkpoint() -> CheckpointResult:
        return CheckpointResult(path=control.checkpoint())

    @app.post("/v1/stop", response_model=Info, responses=errors)
    def stop() -> Info:
        """Finish the current step, evaluate, save the final checkpoint and shut down."""
        control.stop()
        return Info(message="stopping after the current step")

    return Guard(app, token, LOOPBACK_NAMES | {host.lower()}, max_body_bytes, max_concurrent)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ApiServer:
    """Serves the API on a thread; writes `api.json` (its URL) and `api_token` (mode 0600) to the run dir."""

    def __init__(self, control: RunControl, run_dir: Path, host: str = "127.0.0.1", port: int = 0,
                 max_concurrent: int = MAX_CONCURRENT) -> None:
        self.token = secrets.token_urlsafe(32)
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.run_dir = run_dir
        token_file = run_dir / "api_token"
        token_file.unlink(missing_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.token)
        app = build_api(control, self.token, host, max_concurrent=max_concurrent)
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="rlx-api", daemon=True)

    def start(self, timeout_s: float = 30.0) -> ApiServer:
        """Returns once the server accepts connections; only then is `api.json` written."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the management API did not start on {self.url}")
            time.sleep(0.05)
        (self.run_dir / "api.json").write_text(json.dumps({"url": self.url}))
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
