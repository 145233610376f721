"""What the adapters that drive an inference server over HTTP share (`sglang`, `vllm` by URL).

Error replies become `ServerError`s that name the server, the route and the status; an API key
travels as `Authorization: Bearer`; a server on a loopback address is called directly whatever
HTTP(S)_PROXY says (a proxy would see its traffic and its key); requests run on a small thread
pool so results stream back as each finishes while the server batches them. A reply is read in
pieces, up to `MAX_REPLY_BYTES` and within the call's wall-clock timeout (a server that trickles its
body is cut off), and a body that is not sane JSON (too deep, a 5000-digit number) is a ServerError. Weights can also go
by broadcast in a process group formed with the server (`process_group`, `broadcast_tensors`):
the client is rank 0 and hosts the TCP store, the server's ranks follow.
"""

from __future__ import annotations

import abc
import ipaddress
import json
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import requests
import torch
import torch.distributed as dist
import urllib3
from requests.adapters import HTTPAdapter
from transformers import AutoConfig

from rlx.engines.generation.base import GenerationRequest, GenerationResult, SamplingParams, StreamingEngine
from rlx.errors import ConfigError

Refill = Callable[[int], list[GenerationRequest]]
LOGPROB_SLACK = 1e-4  # a log-prob a hair above 0 is rounding; more is not a log-prob
MAX_REPLY_BYTES = 256 << 20  # the largest reply rlx reads from a server (a batch's tokens and log-probs)
READ_PIECE = 64 << 10
MAX_GROUP_TIMEOUT_S = 3600.0  # the longest a server's weight group waits (a server refuses longer)
WeightGroup = Any  # a c10d ProcessGroupGloo or ProcessGroupNCCL, used without a default group


class ServerError(RuntimeError):
    """A server's route failed; the message names the server kind and address (when known), the
    route, the HTTP status and the reply's start."""

    kind: ClassVar[str] = "server"

    def __init__(self, route: str, status: int | None, detail: str, server: str = "") -> None:
        self.route, self.status, self.server = route, status, server
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{self.kind} {server}{route} failed ({where}): {detail}")


def excerpt(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "…"


def error_detail(text: str) -> str:
    """What went wrong, from an error body: its `message`, `error.message`, `error` or `detail`
    (SGLang, OpenAI-style and FastAPI bodies) when present."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, a number past Python's digit limit, too deep
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        data = data["error"]
    if isinstance(data, dict):
        for key in ("message", "error", "detail"):
            if isinstance(data.get(key), str):
                return excerpt(data[key])
    return excerpt(text) or "(empty body)"


def check_response(route: str, status: int, text: str, expect_json: bool = True, server: str = "",
                   error: type[ServerError] = ServerError) -> Any:
    """The reply's JSON (or text); raises `error` on a non-2xx status, a body that is not JSON
    where JSON is due, or `{"success": false, "message": ...}`."""
    if not 200 <= status < 300:
        raise error(route, status, error_detail(text), server)
    if not expect_json:
        return text
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise error(route, status, f"reply is not JSON: {excerpt(text) or '(empty body)'}", server) from None
    except (ValueError, RecursionError) as bad:  # a number past Python's digit limit; nesting too deep
        raise error(route, status, f"reply is JSON rlx will not read ({type(bad).__name__}: "
                    f"{excerpt(str(bad), 120)})", server) from None
    if isinstance(data, dict) and data.get("success") is False:
        raise error(route, status, error_detail(text), server)
    return data


def read_reply(response: requests.Response, route: str, server: str, limit: int, deadline: float,
               error: type[ServerError] = ServerError) -> str:
    """The body of a response opened with `stream=True`, as text: read piece by piece (each piece
    what one read returns) and refused once over `limit` bytes or past `deadline` (monotonic)."""
    pieces, size = [], 0
    try:
        while piece := response.raw.read1(READ_PIECE, decode_content=True):
            size += len(piece)
            if size > limit:
                raise error(route, response.status_code, f"reply over {limit} bytes", server)
            if time.monotonic() > deadline:
                raise error(route, response.status_code, "reply not complete within the timeout "
                            f"({size} bytes so far)", server)
            pieces.append(piece)
    except (urllib3.exceptions.HTTPError, OSError) as failed:
        raise error(route, response.status_code, f"reading the reply: {type(failed).__name__}: "
                    f"{excerpt(str(failed), 200)}", server) from failed
    finally:
        response.close()
    return b"".join(pieces).decode(response.encoding or "utf-8", errors="replace")


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key_from(options: dict[str, Any]) -> str | None:
    """The server's API key from `api_key_env` (an environment variable's name) or `api_key`."""
    if "api_key" in options and "api_key_env" in options:
        raise ConfigError("rollout.engine_options: give api_key_env or api_key, not both")
    if "api_key_env" in options:
        name = options["api_key_env"]
        key = os.environ.get(name, "")
        if not key:
            raise ConfigError(f"rollout.engine_options.api_key_env={name!r}: that environment variable is unset "
                              "or empty where the rollout runs; export it (the server's --api-key)")
    else:
        key = options.get("api_key") or ""
    if key and not (key.isascii() and key.isprintable() and " " not in key):
        raise ConfigError("rollout.engine_options: the server's API key must be printable ASCII without spaces")
    return key or None


def parse_version(value: Any, default: int) -> int:
    """Servers report `weight_version` as a string (SGLang's is "default" until a caller sets one)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def token_problem(logprob: Any, token_id: Any, vocab_size: int | None) -> str | None:
    """Why a reply's (log-prob, token id) pair cannot be trained on, or None when it can."""
    if not (isinstance(logprob, (int, float)) and not isinstance(logprob, bool)
            and isinstance(token_id, int) and not isinstance(token_id, bool)):
        return f"entry ({logprob!r}, {token_id!r}) is not a log-prob and a token id"
    if not math.isfinite(logprob) or logprob > LOGPROB_SLACK:
        return f"log-prob {logprob!r} of token {token_id} is not a finite number <= 0"
    if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
        return f"token id {token_id} is outside the vocabulary [0, {vocab_size})"
    return None


def vocab_size(path: Path, tokenizer: Any) -> int:
    """Token ids the policy can take: its embedding rows (often padded past the tokenizer) or the
    tokenizer's ids, whichever is larger."""
    rows = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    return max(len(tokenizer), rows or 0)


def tensor_chunks(state_dict: dict[str, torch.Tensor], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split a state dict, in order, into runs of at most `max_bytes` (a bigger tensor goes alone)."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as servers name it on the wire: `getattr(torch, name)` gives the dtype back."""
    return str(dtype).removeprefix("torch.")


def process_group(store: dist.Store, group_name: str, backend: str, rank: int, world_size: int,
                  timeout: timedelta, host: str | None = None) -> WeightGroup:
    """A process group on its own, without `init_process_group`'s global default group.

    Its keys sit in the store under the same prefixes as in SGLang's `init_custom_process_group`
    (group name, then `<group name>/`, then the device), so both sides rendezvous on one store.
    `host`: the interface a gloo rank listens on (default: the one this machine's name resolves to)."""
    prefixed = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        device = dist.ProcessGroupGloo.create_device(hostname=host) if host else \
            dist.ProcessGroupGloo.create_default_device()
        options._devices = [device]
        return dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefixed), rank, world_size, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", prefixed), rank, world_size, options)
    raise ValueError(f"backend {backend!r} is neither gloo nor nccl")


def interface_towards(host: str, port: int) -> str:
    """The address of this machine's interface that routes to `host` (a UDP connect sends nothing):
    what a gloo rank must listen on for a peer there to reach it, where the machine's own name may
    resolve to 127.0.1.1."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def broadcast_tensors(group: WeightGroup, tensors: list[torch.Tensor]) -> None:
    """Broadcast each tensor from rank 0 in order (rank 0 sends, every other rank receives in place)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for work in [group.broadcast([tensor], options) for tensor in tensors]:
        work.wait()


def in_background(fn: Callable[[], Any]) -> Future:
    """Run `fn` on a daemon thread: a collective whose peer never shows up must not block exit."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(error)

    threading.Thread(target=run, name="server-weights", daemon=True).start()
    return future


class ServerEngine(StreamingEngine):
    """A generation engine that is an HTTP client of one server: `_call` one route, `stream` many
    requests at once. Subclasses send one request in `_generate_one`."""

    error: ClassVar[type[ServerError]] = ServerError

    def __init__(self, url: str, timeout_s: float, max_concurrency: int, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self._session = requests.Session()
        self._session.trust_env = not is_loopback(self.url)  # no proxy (nor .netrc) for a local server
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"
        self._session.mount(self.url, HTTPAdapter(pool_connections=1, pool_maxsize=max_concurrency))

    def _call(self, method: str, route: str, body: dict | None = None, expect_json: bool = True,
              params: dict[str, Any] | None = None) -> Any:
        deadline = time.monotonic() + self.timeout_s
        try:
            response = self._session.request(method, self.url + route, json=body, params=params,
                                             timeout=self.timeout_s, stream=True)
        except requests.RequestException as error:
            raise self.error(route, None, f"{type(error).__name__}: {error}", self.url) from error
        text = read_reply(response, route, self.url, MAX_REPLY_BYTES, deadline, self.error)
        return check_response(route, response.status_code, text, expect_json, self.url, self.error)

    @abc.abstractmethod
    def _generate_one(self, request: GenerationRequest, params: SamplingParams) -> GenerationResult:
        """Send one request and wait for its result (runs on the stream's thread pool)."""

    def stream(
        self,
        requests: list[GenerationRequest],
        params: SamplingParams,
        refill: Refill | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> Iterator[GenerationResult]:
        """Yield each result as soon as its request finishes.

        Up to `max_concurrency` requests are in flight at once; `refill(free_slots)` may hand over
        more whenever slots are free (as in `hf`, once 1/8 of them are); `between_steps()` runs
        after every completion (e.g. to load newer weights)."""
        pending = deque(requests)
        bulk = max(1, self.max_concurrency // 8)
        in_flight: dict[Future, GenerationRequest] = {}
        pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="server-generate")
        try:
            while True:
                free = self.max_concurrency - len(in_flight)
                if refill is not None and free > len(pending) and (free >= bulk or not in_flight):
                    pending.extend(refill(free - len(pending)))
                while pending and len(in_flight) < self.max_concurrency:
                    request = pending.popleft()
                    in_flight[pool.submit(self._generate_one, request, params)] = request
                if not in_flight:
                    return
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    del in_flight[future]
                    yield future.result()
                    if between_steps is not None:
                        between_steps()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
