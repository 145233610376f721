"""rlx's `hf` engine behind SGLang's HTTP routes: a real server to test the `sglang` adapter on CPU.

A test fixture, not part of rlx: it lives with the tests, and serves the engine through
`rlx.engines.generation.engine_loop.EngineLoop`.

Routes and shapes follow SGLang (`/generate`, `/get_model_info`, `/health`, `/pause_generation`,
`/continue_generation`, `/flush_cache`, `/update_weights_from_tensor`, `/init_weights_update_group`,
`/update_weights_from_distributed`); `/get_server_info` adds the batching counters. What differs:
token ids only (no `text` prompts, no streaming), no prompt log-probs, `sampling_seed` is ignored
(one random stream per batch), `pause_generation` takes `retract` or `in_place` (both keep requests
in flight, with their KV cache, until `continue_generation`), the process group is gloo only, and
`/flush_cache` has nothing to flush (the `hf` engine keeps no cache across requests).

Routed experts (mixture-of-experts models) come as SGLang sends them: started with
`enable_return_routed_experts` (`--enable-return-routed-experts`), the `hf` engine records its
routers' choices in every forward it runs (`rlx.models.moe.MoeRouting` capture: the prompt's prefill,
then each generated token fed back), and a request with `return_routed_experts` gets them in
`meta_info.routed_experts`: base64 of little-endian int32 `[prompt + output - 1, decoder layers,
top_k]`, dense layers' rows 0. Without the flag the field is left out, as SGLang does. `tamper`
edits each `/generate` reply before it is sent: tests inject malformed replies with it.

Run it from the repository root: `python -m tests.support.sglang_server --model tiny-char --port 30000`
(127.0.0.1 only).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
import torch.distributed as dist
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from rlx.engines.generation import EngineSpec, build_generation_engine
from rlx.engines.generation.base import GenerationResult, SamplingParams
from rlx.engines.generation.engine_loop import EngineLoop
from rlx.engines.generation.server_client import WeightGroup, broadcast_tensors, process_group
from rlx.models import resolve_model_path
from rlx.models.moe import find_routers

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "sampling_seed",
                 "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}


def sampling_params_from_body(body: dict[str, Any]) -> SamplingParams:
    """rlx SamplingParams from SGLang's `sampling_params` (same defaults, same validity rules);
    ValueError names what this server does not support."""
    unsupported = sorted(set(body) - SAMPLING_KEYS)
    if unsupported:
        raise ValueError(f"sampling params {unsupported} are not supported by the rlx hf server")
    temperature, top_p, top_k = float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0)), int(body.get("top_k", -1))
    if temperature < 0:
        raise ValueError(f"temperature must be non-negative, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}")
    stop = body.get("stop") or ()
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=max(top_k, 0), max_new_tokens=int(body.get("max_new_tokens", 128)),
        stop=(stop,) if isinstance(stop, str) else tuple(stop), stop_token_ids=tuple(body.get("stop_token_ids") or ()),
    )


class _TensorUnpickler(pickle.Unpickler):
    """Loads a pickled list of CPU tensors and nothing else: only the three callables such a pickle
    names are found, and storage bytes load with `weights_only=True`, so a crafted body runs no code."""

    ALLOWED: ClassVar = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in serialized_named_tensors")


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """One `serialized_named_tensors` entry (see `sglang.serialize_named_tensors`) back to `[(name, tensor)]`."""
    named = _TensorUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    if not (isinstance(named, list) and all(isinstance(n, tuple) and len(n) == 2 and isinstance(n[0], str)
                                            and isinstance(n[1], torch.Tensor) for n in named)):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return named


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")  # noqa: TRY004 - a wrong name, not a wrong type
    return dtype


class _Body(BaseModel):
    """The part of an SGLang io_struct class this server honours: other fields are refused (422),
    not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class GenerateReqInput(_Body):
    input_ids: list[int] | list[list[int]]
    sampling_params: dict[str, Any] | list[dict[str, Any]] = {}
    return_logprob: bool = False
    logprob_start_len: int = -1
    stream: bool = False
    rid: str | list[str] | None = None
    return_routed_experts: bool = False


class PauseGenerationReqInput(_Body):
    mode: str = "abort"


class UpdateWeightsFromTensorReqInput(_Body):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True  # nothing to flush here
    weight_version: str | None = None


class InitWeightsUpdateGroupReqInput(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True  # nothing to flush here
    weight_version: str | None = None
    load_format: str | None = None


def _error(status: int, error: Exception) -> JSONResponse:
    return JSONResponse({"error": {"message": str(error)}}, status_code=status)


def _failure(error: Exception) -> JSONResponse:
    return JSONResponse({"success": False, "message": str(error)}, status_code=400)


def _jobs(body: GenerateReqInput, vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    """(prompt ids, params) per prompt; ValueError for anything this server will not run."""
    if body.stream:
        raise ValueError("streaming replies are not supported by the rlx hf server")
    if body.return_logprob and body.logprob_start_len != -1:
        raise ValueError("prompt log-probs (logprob_start_len != -1) are not supported by the rlx hf server")
    prompts = body.input_ids if body.input_ids and isinstance(body.input_ids[0], list) else [body.input_ids]
    settings = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * len(prompts)
    if len(settings) != len(prompts):
        raise ValueError(f"{len(settings)} sampling_params for {len(prompts)} prompts")
    for ids in prompts:
        if not ids:
            raise ValueError("input_ids is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab_size})")
    return [(ids, sampling_params_from_body(s)) for ids, s in zip(prompts, settings)]


def router_layers(model: torch.nn.Module) -> tuple[list[int], int]:
    """(indices of the decoder layers that hold a router, number of decoder layers): SGLang sends a
    row per decoder layer, the `hf` engine records one per router."""
    layers = model.get_decoder().layers
    return [i for i, layer in enumerate(layers) if find_routers(layer)], len(layers)


def sglang_routed_experts(routes: torch.Tensor, moe_layers: list[int], num_layers: int) -> str:
    """rlx routes `[N, MoE layers, K]` as SGLang's `meta_info.routed_experts`: base64 of
    little-endian int32 `[N, num_layers, K]`, dense layers' rows left 0 as in SGLang's buffers."""
    full = torch.zeros(routes.shape[0], num_layers, routes.shape[2], dtype=torch.int32)
    full[:, moe_layers] = routes.to(torch.int32)
    return base64.b64encode(full.numpy().astype("<i4").tobytes()).decode("ascii")


def _reply(result: GenerationResult, params: SamplingParams, stop_ids: set[int], tokenizer: Any,
           return_logprob: bool, rid: str | None) -> dict[str, Any]:
    text = tokenizer.decode(result.response_ids, skip_special_tokens=True)
    if result.finish_reason == "length":
        finish: dict[str, Any] = {"type": "length", "length": len(result.response_ids)}
    else:
        last = result.response_ids[-1]
        matched = last if last in stop_ids else next((s for s in params.stop if text.endswith(s)), None)
        finish = {"type": "stop", "matched": matched}
    meta: dict[str, Any] = {
        "id": rid or uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(result.response_ids), "cached_tokens": 0,
        "weight_version": str(result.extra["last_weight_version"]),
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, result.response_ids)]
    return {"text": text, "output_ids": result.response_ids, "meta_info": meta}


def build_app(loop: EngineLoop, tokenizer: Any, model_path: str, group_timeout_s: float = 300.0,
              tamper: Callable[[dict[str, Any]], None] = lambda reply: None) -> FastAPI:
    """The FastAPI app: SGLang's routes over an EngineLoop. `tamper` may edit each `/generate`
    reply in place before it is sent (fault injection)."""
    app = FastAPI(title="rlx hf engine (SGLang routes)")
    engine = loop.engine
    vocab_size = engine.model.get_input_embeddings().num_embeddings
    moe_layers, num_layers = router_layers(engine.model)
    groups: dict[str, WeightGroup] = {}

    def load(named: list[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        """Partial updates are fine (as in SGLang): unnamed weights keep their values. Names and
        shapes are checked before anything is copied, so a bad update changes nothing."""
        if weight_version is not None and not weight_version.lstrip("-").isdigit():
            raise ValueError(f"weight_version {weight_version!r} is not an integer (rlx versions are)")
        version = engine.weight_version if weight_version is None else int(weight_version)

        def apply() -> None:
            state = engine.model.state_dict()
            for name, tensor in named:
                if name not in state:
                    raise ValueError(f"{name!r} is not a weight of {model_path}")
                if tensor.shape != state[name].shape:
                    raise ValueError(f"{name!r} has shape {list(tensor.shape)}, expected {list(state[name].shape)}")
            engine.load_weights({**state, **dict(named)}, version)

        loop.run_on_engine_thread(apply)

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    def get_model_info() -> dict[str, Any]:
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
                "weight_version": str(engine.weight_version)}

    @app.get("/get_server_info")
    def get_server_info() -> dict[str, Any]:
        return {"model_path": model_path, "weight_version": str(engine.weight_version),
                "max_running_requests": engine.max_batch_size,
                "internal_states": [{"decode_steps": loop.decode_steps, "peak_batch": loop.peak_batch}]}

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: GenerateReqInput) -> Any:
        try:
            jobs = _jobs(body, vocab_size)
        except ValueError as error:
            return _error(400, error)
        futures = [loop.submit(ids, params) for ids, params in jobs]
        try:
            results = [await asyncio.wrap_future(future) for future in futures]
        except Exception as error:  # noqa: BLE001 - reported to the client
            return _error(500, error)
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(jobs)
        stop_ids = set(engine.eos_token_ids)
        replies = [_reply(result, params, stop_ids | set(params.stop_token_ids), tokenizer, body.return_logprob, rid)
                   for result, (_, params), rid in zip(results, jobs, rids)]
        for reply, result in zip(replies, results):
            if body.return_routed_experts and result.routed_experts is not None:  # None: the server flag is off
                reply["meta_info"]["routed_experts"] = sglang_routed_experts(result.routed_experts, moe_layers,
                                                                             num_layers)
            tamper(reply)
        return replies if isinstance(body.input_ids[0], list) else replies[0]

    @app.post("/pause_generation")
    def pause_generation(body: PauseGenerationReqInput | None = None) -> Any:
        mode = (body or PauseGenerationReqInput()).mode
        if mode not in ("retract", "in_place"):
            return _error(400, ValueError(f"pause mode {mode!r} is not supported here; use retract or in_place"))
        loop.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    def continue_generation() -> dict[str, str]:
        loop.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache() -> PlainTextResponse:
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weights_from_tensor")
    def update_weights_from_tensor(body: UpdateWeightsFromTensorReqInput) -> Any:
        try:
            if body.load_format not in (None, "direct"):
                raise ValueError(f"load_format {body.load_format!r} is not supported here")
            if not body.serialized_named_tensors:
                raise ValueError("serialized_named_tensors is empty")
            load(deserialize_named_tensors(body.serialized_named_tensors[0]), body.weight_version)  # this is TP rank 0
        except Exception as error:  # noqa: BLE001 - reported as SGLang does
            return _failure(error)
        return {"success": True, "message": "Succeeded to update model weights."}

    @app.post("/init_weights_update_group")
    def init_weights_update_group(body: InitWeightsUpdateGroupReqInput) -> Any:
        try:
            if body.backend != "gloo":
                raise ValueError(f"backend {body.backend!r} is not available on this CPU server; use gloo")
            timeout = timedelta(seconds=group_timeout_s)
            store = dist.TCPStore(body.master_address, body.master_port, body.world_size, is_master=False,
                                  timeout=timeout)
            groups[body.group_name] = process_group(store, body.group_name, "gloo", body.rank_offset,
                                                    body.world_size, timeout)
        except Exception as error:  # noqa: BLE001 - reported as SGLang does
            return _failure(error)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    def update_weights_from_distributed(body: UpdateWeightsFromDistributedReqInput) -> Any:
        """Receive every tensor first, then check and load: the group stays in step even when the
        update is refused."""
        try:
            if body.load_format not in (None, "direct"):
                raise ValueError(f"load_format {body.load_format!r} is not supported here")
            if body.group_name not in groups:
                raise ValueError(f"no weight update group {body.group_name!r}; call /init_weights_update_group")
            if not len(body.names) == len(body.dtypes) == len(body.shapes):
                raise ValueError("names, dtypes and shapes differ in length")
            tensors = [torch.empty(shape, dtype=parse_dtype(d)) for d, shape in zip(body.dtypes, body.shapes)]
            broadcast_tensors(groups[body.group_name], tensors)
            load(list(zip(body.names, tensors)), body.weight_version)
        except Exception as error:  # noqa: BLE001 - reported as SGLang does
            return _failure(error)
        return {"success": True, "message": "Succeeded to update parameter online."}

    return app


class LoopbackServer:
    """The `hf` engine served on 127.0.0.1: `start()` runs uvicorn on a background thread (tests),
    `serve()` in the calling thread (the command line). Port 0 picks a free port; `port` tells it.
    `enable_return_routed_experts` is SGLang's server flag of that name; `tamper`, when set, edits
    each `/generate` reply before it is sent (tests inject faults with it)."""

    def __init__(self, model: str | Path, port: int = 0, max_batch_size: int = 64,
                 enable_return_routed_experts: bool = False) -> None:
        path = resolve_model_path(str(model))
        spec = EngineSpec(path, max_batch_size=max_batch_size, record_routes=enable_return_routed_experts)
        engine, tokenizer = build_generation_engine("hf", spec)
        self.loop = EngineLoop(engine)
        self.tamper: Callable[[dict[str, Any]], None] | None = None
        self._socket = socket.create_server(("127.0.0.1", port))  # bound now, so the port is known at once
        self.port: int = self._socket.getsockname()[1]
        app = build_app(self.loop, tokenizer, str(path), tamper=self._tamper)
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _tamper(self, reply: dict[str, Any]) -> None:
        if self.tamper is not None:
            self.tamper(reply)

    def serve(self) -> None:
        try:
            self._uvicorn.run(sockets=[self._socket])
        finally:
            self.loop.stop()

    def start(self, timeout_s: float = 30.0) -> Self:
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]},
                                        name="rlx-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Fail requests still waiting (so no handler hangs), then shut uvicorn down."""
        self.loop.stop()
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._socket.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder or a built-in model name")
    parser.add_argument("--port", type=int, default=30000, help="port on 127.0.0.1 (0 picks a free one)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="requests decoding together")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="record MoE routes and return them to requests with return_routed_experts")
    args = parser.parse_args(argv)
    server = LoopbackServer(args.model, args.port, args.max_batch_size, args.enable_return_routed_experts)
    print(f"serving {args.model} on {server.url}", flush=True)
    server.serve()


if __name__ == "__main__":
    main()
