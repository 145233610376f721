"""The `sglang` engine: drives an SGLang server over its HTTP API.

Bodies and replies use SGLang's own field names (`sglang/srt/managers/io_struct.py`,
`sglang/srt/entrypoints/http_server.py`): `POST /generate` with `input_ids`, `sampling_params`,
`return_logprob`; weight updates through `/update_weights_from_tensor` or, after
`/init_weights_update_group`, `/update_weights_from_distributed` (the trainer is rank 0 of a
process group and broadcasts each tensor); `/pause_generation`, `/flush_cache`,
`/continue_generation` around every update. Each request is one HTTP call on a small thread pool,
so results stream back as each finishes while the server batches them.

`rollout.engine_options`: `url` (required), `timeout_s` (per HTTP call, default 600), `tp_size`
(the server's tensor-parallel ranks, default 1), `weight_chunk_mb` (largest
`/update_weights_from_tensor` body, default 512) and `max_concurrency` (requests in flight, default
`max_batch_size`).
"""

from __future__ import annotations

import base64
import json
import pickle
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any

import requests
import torch
import torch.distributed as dist
from requests.adapters import HTTPAdapter

from rlx.engines.generation import EngineSpec
from rlx.engines.generation.base import GenerationRequest, GenerationResult, SamplingParams, StreamingEngine
from rlx.errors import ConfigError
from rlx.models import load_tokenizer

OPTIONS = {"url", "timeout_s", "tp_size", "weight_chunk_mb", "max_concurrency"}
Refill = Callable[[int], list[GenerationRequest]]
WeightGroup = Any  # a c10d ProcessGroupGloo or ProcessGroupNCCL, used without a default group


class SGLangError(RuntimeError):
    """An SGLang route failed; the message names the route, the HTTP status and the reply's start."""

    def __init__(self, route: str, status: int | None, detail: str) -> None:
        self.route, self.status = route, status
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"SGLang {route} failed ({where}): {detail}")


def excerpt(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "…"


def error_detail(text: str) -> str:
    """What went wrong, from an error body: SGLang's `message` or `error.message` when present."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        data = data["error"]
    if isinstance(data, dict) and isinstance(data.get("message"), str):
        return excerpt(data["message"])
    return excerpt(text) or "(empty body)"


def check_response(route: str, status: int, text: str, expect_json: bool = True) -> Any:
    """The reply's JSON (or text); raises `SGLangError` on a non-2xx status, a body that is not
    JSON where JSON is due, or SGLang's `{"success": false, "message": ...}`."""
    if not 200 <= status < 300:
        raise SGLangError(route, status, error_detail(text))
    if not expect_json:
        return text
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise SGLangError(route, status, f"reply is not JSON: {excerpt(text) or '(empty body)'}") from None
    if isinstance(data, dict) and data.get("success") is False:
        raise SGLangError(route, status, error_detail(text))
    return data


def sampling_params_body(params: SamplingParams, request_id: int) -> dict[str, Any]:
    """SGLang's `sampling_params`: `top_k=-1` is "off" there (rlx uses 0) and temperature 0 is
    greedy in both. A seed becomes a per-request `sampling_seed`, distinct per request so the n
    samples of a prompt differ (SGLang honours it only with deterministic inference enabled)."""
    body: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
    }
    if params.seed is not None:
        body["sampling_seed"] = params.seed + request_id
    return body


def generate_body(request: GenerationRequest, params: SamplingParams) -> dict[str, Any]:
    """One `/generate` request: token ids in, per-token log-probs of the output only
    (`logprob_start_len=-1`)."""
    return {
        "input_ids": list(request.prompt_ids),
        "sampling_params": sampling_params_body(params, request.request_id),
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def parse_version(value: Any, default: int) -> int:
    """SGLang's `weight_version` is a string ("default" until a caller sets one)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def result_from_response(request: GenerationRequest, reply: Any, weight_version: int) -> GenerationResult:
    """A `/generate` reply as a GenerationResult. Token ids and log-probs both come from
    `meta_info.output_token_logprobs` (`[logprob, token_id, text]` per token), which pairs them
    and includes the final stop token; `weight_version` is the version the request was sent under."""

    def malformed(why: str) -> SGLangError:
        return SGLangError("/generate", 200, f"malformed reply ({why}): {excerpt(json.dumps(reply))}")

    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    if not isinstance(meta, dict):
        raise malformed("no meta_info")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "abort":
        raise SGLangError("/generate", 200, f"request {request.request_id} was aborted: {finish.get('message')}")
    if kind not in ("stop", "length"):
        raise malformed(f"finish_reason {finish!r}")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise malformed("no output_token_logprobs")
    logprobs, token_ids = [], []
    for entry in entries:
        if not (isinstance(entry, (list, tuple)) and len(entry) >= 2 and isinstance(entry[0], (int, float))
                and isinstance(entry[1], int) and not isinstance(entry[1], bool)):
            raise malformed(f"output_token_logprobs entry {entry!r}")
        logprobs.append(float(entry[0]))
        token_ids.append(entry[1])
    return GenerationResult(
        request_id=request.request_id,
        prompt_ids=list(request.prompt_ids),
        response_ids=token_ids,
        logprobs=logprobs,
        finish_reason=kind,
        weight_version=weight_version,
        extra={"last_weight_version": parse_version(meta.get("weight_version"), weight_version)},
    )


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


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One entry of `serialized_named_tensors`: base64 of a plain pickle of `[(name, cpu tensor)]`.

    SGLang's own clients pickle with `ForkingPickler`, which turns a tensor into a CUDA IPC handle
    or a shared-memory file descriptor: both resolve only on the sender's host. A plain pickle
    carries the bytes, so it loads anywhere, and SGLang's unpickler accepts it (torch and builtins
    only). Views are copied so a slice never ships its whole base storage."""
    tensors = []
    for name, tensor in named:
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        tensors.append((name, tensor))
    return base64.b64encode(pickle.dumps(tensors, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's `dtypes` entries: `getattr(torch, name)` must give the dtype back."""
    return str(dtype).removeprefix("torch.")


def process_group(store: dist.Store, group_name: str, backend: str, rank: int, world_size: int,
                  timeout: timedelta) -> WeightGroup:
    """A process group on its own, without `init_process_group`'s global default group.

    Its keys sit in the store under the same prefixes as in SGLang's `init_custom_process_group`
    (group name, then `<group name>/`, then the device), so both sides rendezvous on one store."""
    prefixed = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    if backend == "gloo":
        return dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefixed), rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", prefixed), rank, world_size, options)
    raise ValueError(f"backend {backend!r} is neither gloo nor nccl")


def broadcast_tensors(group: WeightGroup, tensors: list[torch.Tensor]) -> None:
    """Broadcast each tensor from rank 0 in order (rank 0 sends, every other rank receives in place)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for work in [group.broadcast([tensor], options) for tensor in tensors]:
        work.wait()


def _in_background(fn: Callable[[], Any]) -> Future:
    """Run `fn` on a daemon thread: a collective whose peer never shows up must not block exit."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(error)

    threading.Thread(target=run, name="sglang-weights", daemon=True).start()
    return future


class SGLangEngine(StreamingEngine):
    """The generation-engine interface over one SGLang server (see the module docstring)."""

    def __init__(self, url: str, timeout_s: float = 600.0, max_concurrency: int = 64, tp_size: int = 1,
                 weight_chunk_mb: float = 512.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.tp_size = tp_size
        self.weight_chunk_bytes = max(1, int(weight_chunk_mb * 2**20))
        self._session = requests.Session()
        self._session.mount(self.url, HTTPAdapter(pool_connections=1, pool_maxsize=max_concurrency))
        self._group: WeightGroup | None = None
        self._group_name = ""
        self.weight_version = parse_version(self.model_info().get("weight_version"), 0)

    def _call(self, method: str, route: str, body: dict | None = None, expect_json: bool = True) -> Any:
        try:
            response = self._session.request(method, self.url + route, json=body, timeout=self.timeout_s)
        except requests.RequestException as error:
            raise SGLangError(route, None, f"{self.url}: {type(error).__name__}: {error}") from error
        return check_response(route, response.status_code, response.text, expect_json)

    def model_info(self) -> dict[str, Any]:
        return self._call("GET", "/get_model_info")

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
        pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="sglang-generate")
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

    def _generate_one(self, request: GenerationRequest, params: SamplingParams) -> GenerationResult:
        version = self.weight_version
        return result_from_response(request, self._call("POST", "/generate", generate_body(request, params)), version)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int, shared: bool = False) -> None:
        """Pause, update (by broadcast once `init_weights_update_group` ran, else over HTTP), flush
        the prefix cache (it holds KV computed by the old weights), continue. The pause mode is
        `retract`: requests in flight go back to the queue and resume on the new weights, where
        `abort` would end them and `in_place` would make `/flush_cache` refuse. The bytes travel
        to the server either way, so `shared` changes nothing."""
        self._call("POST", "/pause_generation", {"mode": "retract"})
        try:
            if self._group is not None:
                self.update_weights_from_distributed(state_dict, version)
            else:
                self.update_weights_from_tensor(state_dict, version)
            self._call("GET", "/flush_cache", expect_json=False)
        finally:
            self._call("POST", "/continue_generation", {})

    def update_weights_from_tensor(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Send the weights by value over HTTP, `weight_chunk_mb` at a time; the last call sets the version."""
        chunks = list(tensor_chunks(state_dict, self.weight_chunk_bytes))
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            self._call("POST", "/update_weights_from_tensor", {
                "serialized_named_tensors": [serialize_named_tensors(chunk)] * self.tp_size,  # one per TP rank
                "load_format": None,
                "flush_cache": last,
                "weight_version": str(version) if last else None,
            })
        self.weight_version = version

    def init_weights_update_group(self, master_address: str = "127.0.0.1", master_port: int = 0,
                                  group_name: str = "weight_update_group", backend: str = "gloo") -> None:
        """Form a process group with the server: this process is rank 0 and hosts the TCP store
        (`master_port=0` picks a free port), the server's ranks are 1..tp_size. Use `nccl` with
        CUDA weights on a GPU trainer; `gloo` works anywhere."""
        world_size = 1 + self.tp_size
        timeout = timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        joined = _in_background(lambda: process_group(store, group_name, backend, 0, world_size, timeout))
        self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": store.port, "rank_offset": 1,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        })
        self._group, self._group_name = joined.result(timeout=self.timeout_s), group_name

    def update_weights_from_distributed(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Announce names, dtypes and shapes over HTTP while broadcasting the tensors in that order.

        On failure the group is dropped (its peers may be out of step): call
        `init_weights_update_group` again before the next update."""
        if self._group is None:
            raise RuntimeError("update_weights_from_distributed needs init_weights_update_group first")
        names = list(state_dict)
        tensors = [state_dict[name].detach().contiguous() for name in names]
        group = self._group
        sent = _in_background(lambda: broadcast_tensors(group, tensors))
        try:
            self._call("POST", "/update_weights_from_distributed", {
                "names": names,
                "dtypes": [dtype_name(t.dtype) for t in tensors],
                "shapes": [list(t.shape) for t in tensors],
                "group_name": self._group_name,
                "flush_cache": True,
                "weight_version": str(version),
            })
            sent.result(timeout=self.timeout_s)
        except Exception as error:
            self._group = None
            error.add_note("the weight update group was dropped; call init_weights_update_group again")
            raise
        self.weight_version = version


def build_sglang_engine(spec: EngineSpec) -> tuple[SGLangEngine, Any]:
    """`(engine, tokenizer)`: the server at `options["url"]` serves the model; the tokenizer comes
    from the same folder locally. `dtype`, `device` and `seed` belong to the server's own launch."""
    options = dict(spec.options)
    unknown = set(options) - OPTIONS
    if unknown:
        raise ConfigError(f"unknown sglang engine_options {sorted(unknown)}; known: {sorted(OPTIONS)}")
    if not options.get("url"):
        raise ConfigError("rollout.engine=sglang needs rollout.engine_options.url (e.g. http://127.0.0.1:30000)")
    engine = SGLangEngine(
        options["url"],
        timeout_s=float(options.get("timeout_s", 600.0)),
        max_concurrency=int(options.get("max_concurrency", spec.max_batch_size)),
        tp_size=int(options.get("tp_size", 1)),
        weight_chunk_mb=float(options.get("weight_chunk_mb", 512.0)),
    )
    return engine, load_tokenizer(spec.path)
