"""The management API of a running async job (FastAPI on 127.0.0.1, OpenAPI at /openapi.json).

Every route, reads and the docs included, needs the bearer token generated for this run and
written, readable only by its owner, to `<run_dir>/api_token`. A guard in front of the app
(`rlx.http_guard.Guard`) answers before any body is read: a Host header other than this machine's
names is 421 (DNS rebinding), a missing or wrong token 401, more than `max_concurrent` requests at
once 429; a body over `max_body_bytes` is 413. One scale operation (the API's or the autoscaler's)
runs at a time; a second one gets 409, as does one the cluster cannot place; one that does not
finish in time is 504. Rollout engines added by URL (`POST /v1/rollout/engines`): an unreachable
server or an engine kind without a URL adapter is 422, a URL already added 409, an unknown id 404.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException, Security
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from rlx.http_guard import LOOPBACK_NAMES, TOKEN_HINT, Guard, ServerThread

MAX_ROLLOUT_REPLICAS = 16
MAX_BODY_BYTES = 64 * 1024  # the largest body any route takes is a few bytes of JSON
MAX_CONCURRENT = 8


class ScaleInProgress(RuntimeError):
    """Another scale operation (an API call or the autoscaler) is still running."""


class ScaleRefused(RuntimeError):
    """The cluster cannot place what the scale asks for; the message says what is missing."""


class ScaleTimedOut(TimeoutError):
    """New replicas did not start in time; the scale was undone."""


class EngineRejected(ValueError):
    """A rollout engine that cannot be added by URL (unreachable, or a kind rlx cannot drive by URL);
    the message names the field and the fix."""


class EngineConflict(RuntimeError):
    """The URL is already a rollout engine of this run, or the run holds as many as it may."""


class UnknownEngine(LookupError):
    """No rollout engine added by URL has this id."""


class RunControl(Protocol):
    """What the API can see and do; the async controller implements it."""

    def status(self) -> dict[str, Any]: ...

    def engines(self) -> list[dict[str, Any]]: ...

    def scale(self, replicas: int) -> dict[str, Any]:
        """Raises ScaleInProgress while another scale operation runs, ScaleRefused when the cluster
        cannot place the replicas, ScaleTimedOut when they do not start in time."""

    def add_engine(self, url: str, engine: str) -> dict[str, Any]:
        """Raises EngineRejected, EngineConflict or ScaleRefused (the cluster cannot place its relay)."""

    def remove_engine(self, engine_id: str) -> dict[str, Any]:
        """Raises UnknownEngine."""

    def checkpoint(self) -> str: ...

    def stop(self) -> None: ...


class ScaleRequest(BaseModel):
    """Strict: `true` or `"2"` is not a count, and an unknown field is a mistake, not something to ignore."""

    model_config = ConfigDict(extra="forbid", strict=True)
    replicas: int = Field(ge=1, le=MAX_ROLLOUT_REPLICAS, description="target number of rollout replicas")


class ScaleResult(BaseModel):
    replicas_before: int
    replicas: int


class AddEngineRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    url: str = Field(min_length=1, max_length=2048, description="base URL of a running server, e.g. "
                     "http://127.0.0.1:30000")
    engine: str = Field(max_length=64, description="the server's kind: sglang or vllm")


class EngineInfo(BaseModel):
    id: str
    url: str
    engine: str
    state: str = Field(description="pending, loading, active or draining")


class CheckpointResult(BaseModel):
    path: str


class Detail(BaseModel):
    detail: str


class Info(BaseModel):
    message: str


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
        """Every rollout engine, Serve replicas and engines added by URL: its id, kind, state (pending,
        loading, active, draining), weight version, samples produced, busy fraction."""
        return control.engines()

    @app.post("/v1/rollout/engines", response_model=EngineInfo, status_code=202,
              responses={**errors, 409: {"model": Detail}, 422: {"model": Detail}})
    def add_engine(request: AddEngineRequest) -> EngineInfo:
        """Add a running server as a rollout engine. Accepted once the server answers and its relay
        is deployed (state `pending`); it loads the latest published weights (`loading`) before it
        takes any prompt group (`active`)."""
        try:
            return EngineInfo(**control.add_engine(request.url, request.engine))
        except EngineRejected as bad:
            raise HTTPException(422, str(bad)) from bad
        except (EngineConflict, ScaleRefused) as conflict:
            raise HTTPException(409, str(conflict)) from conflict

    @app.delete("/v1/rollout/engines/{engine_id}", response_model=EngineInfo, status_code=202,
                responses={**errors, 404: {"model": Detail}})
    def remove_engine(engine_id: str) -> EngineInfo:
        """Remove an engine added by URL: it takes no new group, finishes (or hands back) the ones it
        holds (`draining`), then leaves the list. Serve replicas are scaled with /v1/rollout/scale."""
        try:
            return EngineInfo(**control.remove_engine(engine_id))
        except UnknownEngine as unknown:
            raise HTTPException(404, unknown.args[0]) from unknown

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


class ApiServer:
    """Serves the API on a thread; writes `api.json` (its URL) and `api_token` (mode 0600) to the run
    dir, and removes both when it stops."""

    def __init__(self, control: RunControl, run_dir: Path, host: str = "127.0.0.1", port: int = 0,
                 max_concurrent: int = MAX_CONCURRENT) -> None:
        self.token = secrets.token_urlsafe(32)
        self.run_dir = run_dir
        token_file = run_dir / "api_token"
        token_file.unlink(missing_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.token)
        app = build_api(control, self.token, host, max_concurrent=max_concurrent)
        self.serving = ServerThread(app, host, port, "the management API", "rlx-api")
        self.port, self.url = self.serving.port, self.serving.url

    def start(self, timeout_s: float = 30.0) -> ApiServer:
        """Returns once the server accepts connections; only then is `api.json` written (whole: a
        reader never sees half of it)."""
        self.serving.start(timeout_s)
        staged = self.run_dir / ".api.json.partial"
        staged.write_text(json.dumps({"url": self.url}))
        staged.replace(self.run_dir / "api.json")
        return self

    def stop(self) -> None:
        """Stops serving and removes `api.json` and `api_token`: a stopped run has no API to point at."""
        self.serving.stop()
        for name in ("api.json", "api_token"):
            (self.run_dir / name).unlink(missing_ok=True)
