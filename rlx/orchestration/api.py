"""The management API of a running async job (FastAPI on 127.0.0.1, OpenAPI at /openapi.json).

Reading is open to whoever can reach the loopback port; every call that changes the run needs
the bearer token generated for this run and written, readable only by its owner, to
`<run_dir>/api_token`. One scale operation (the API's or the autoscaler's) runs at a time; a
second one gets 409.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import uvicorn
from fastapi import Depends, FastAPI, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

MAX_ROLLOUT_REPLICAS = 16


class ScaleInProgress(RuntimeError):
    """Another scale operation (an API call or the autoscaler) is still running."""


class RunControl(Protocol):
    """What the API can see and do; the async controller implements it."""

    def status(self) -> dict[str, Any]: ...

    def engines(self) -> list[dict[str, Any]]: ...

    def scale(self, replicas: int) -> dict[str, Any]:
        """Raises ScaleInProgress while another scale operation runs."""

    def checkpoint(self) -> str: ...

    def stop(self) -> None: ...


class ScaleRequest(BaseModel):
    replicas: int = Field(ge=1, le=MAX_ROLLOUT_REPLICAS, description="target number of rollout replicas")


class ScaleResult(BaseModel):
    replicas_before: int
    replicas: int


class CheckpointResult(BaseModel):
    path: str


class Message(BaseModel):
    message: str


def build_api(control: RunControl, token: str) -> FastAPI:
    app = FastAPI(title="rlx management API", version="1")
    bearer = HTTPBearer(auto_error=False)

    def require_token(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if credentials is None or not secrets.compare_digest(credentials.credentials, token):
            raise HTTPException(401, "missing or wrong bearer token (it is in <run_dir>/api_token)",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.get("/v1/status")
    def status() -> dict[str, Any]:
        """Step, roles with their replicas, recoveries, prompt and bus counters."""
        return control.status()

    @app.get("/v1/rollout/engines")
    def engines() -> list[dict[str, Any]]:
        """Every rollout replica: its id, weight version, samples produced, busy fraction."""
        return control.engines()

    @app.post("/v1/rollout/scale", dependencies=[Depends(require_token)], response_model=ScaleResult,
              responses={401: {"model": Message}, 409: {"model": Message}})
    def scale(request: ScaleRequest) -> ScaleResult:
        """New replicas load the latest weights before they generate; removed ones finish or hand back their groups."""
        try:
            return ScaleResult(**control.scale(request.replicas))
        except ScaleInProgress as busy:
            raise HTTPException(409, f"{busy}; try again when it has finished") from busy

    @app.post("/v1/checkpoint", dependencies=[Depends(require_token)], response_model=CheckpointResult,
              responses={401: {"model": Message}})
    def checkpoint() -> CheckpointResult:
        return CheckpointResult(path=control.checkpoint())

    @app.post("/v1/stop", dependencies=[Depends(require_token)], response_model=Message,
              responses={401: {"model": Message}})
    def stop() -> Message:
        """Finish the current step, evaluate, save the final checkpoint and shut down."""
        control.stop()
        return Message(message="stopping after the current step")

    return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ApiServer:
    """Serves the API on a thread; writes `api.json` (its URL) and `api_token` (mode 0600) to the run dir."""

    def __init__(self, control: RunControl, run_dir: Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.token = secrets.token_urlsafe(32)
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.run_dir = run_dir
        token_file = run_dir / "api_token"
        token_file.unlink(missing_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.token)
        config = uvicorn.Config(build_api(control, self.token), host=host, port=self.port, log_level="warning")
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
