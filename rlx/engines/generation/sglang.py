"""The `sglang` engine: drives an SGLang server over its HTTP API.

Bodies and replies use SGLang's own field names (`sglang/srt/managers/io_struct.py`,
`sglang/srt/entrypoints/http_server.py`): `POST /generate` with `input_ids`, `sampling_params`,
`return_logprob`; weight updates through `/update_weights_from_tensor` or, after
`/init_weights_update_group`, `/update_weights_from_distributed` (the trainer is rank 0 of a
process group and broadcasts each tensor); `/pause_generation`, `/flush_cache`,
`/continue_generation` around every update. Each request is one HTTP call on a small thread pool,
so results stream back as each finishes while the server batches them.

Routed experts (mixture-of-experts models, for Rollout Routing Replay): with `return_routed_experts`
on (or `EngineSpec.record_routes`, which R3 sets), every `/generate` body carries
`"return_routed_experts": true` (`GenerateReqInput` in `sglang/srt/managers/io_struct.py`), and each
result's `routed_experts` holds the experts the server chose, in `rlx.models.moe`'s layout. SGLang
sends them only when started with `--enable-return-routed-experts`
(`ServerArgs.enable_return_routed_experts`, `sglang/srt/server_args.py`); without it the field is
silently left out, which rlx reports as an error naming that flag. The reply's
`meta_info.routed_experts` is base64 of a flat little-endian int32 array
(`encode_routed_experts_for_wire` in `sglang/srt/state_capturer/routed_experts_wire.py`; newer
servers may send uint16 or uint8 and say so in `meta_info.routed_experts_dtype`) of shape
`[seqlen - 1, num_hidden_layers, num_experts_per_tok]`: one row per position the model ran
(`BaseTopkCapturer.get_topk` in `sglang/srt/state_capturer/base.py` gathers `[0, seqlen - 1)`,
seqlen = prompt + output tokens, so the last sampled token has none), one per decoder layer in order
with dense layers left at 0 (`RoutedExpertsCapturer` in
`sglang/srt/state_capturer/routed_experts.py` sizes the buffer by `num_hidden_layers`), and the
top-k expert ids as the router chose them (`sglang/srt/layers/moe/topk.py` captures after
`topk_ids_logical_to_physical`: with EPLB's redundant experts they are physical slots, which the
range check below rejects). rlx keeps the rows of the MoE layers (`RouteLayout`).

`rollout.engine_options`: `url` (required), `timeout_s` (per HTTP call, default 600), `tp_size`
(the server's tensor-parallel ranks, default 1), `weight_chunk_mb` (largest
`/update_weights_from_tensor` body, default 512), `max_concurrency` (requests in flight, default
`max_batch_size`), `return_routed_experts` (ask for the routed experts, above; default false), and
the server's `--api-key`, sent as `Authorization: Bearer`: `api_key_env` (the name of an environment
variable holding it; preferred, as the config is saved in the run directory) or `api_key` itself.

Replies are checked before anything trains on them: every output token id must be in the model's
vocabulary, every log-prob a finite number <= 0, and routed experts must decode, cover exactly
len(prompt) + len(response) - 1 positions and name experts the model has. A server on a loopback
address is called directly, whatever HTTP(S)_PROXY says: a proxy would see its traffic and its key.
"""

from __future__ import annotations

import base64
import binascii
import json
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from rlx.engines.generation.base import EngineSpec, GenerationRequest, GenerationResult, SamplingParams
from rlx.engines.generation.server_client import (
    ServerEngine,
    ServerError,
    WeightGroup,
    api_key_from,
    broadcast_tensors,
    dtype_name,
    excerpt,
    in_background,
    parse_version,
    process_group,
    tensor_chunks,
    token_problem,
    vocab_size,
)
from rlx.errors import ConfigError
from rlx.model_kinds import EXPERT_COUNT_KEYS
from rlx.models import load_tokenizer
from rlx.models.moe import NOT_RECORDED, ROUTE_DTYPE
from rlx.weights.broadcast import serve_store

OPTIONS = {"url", "api_key", "api_key_env", "timeout_s", "tp_size", "weight_chunk_mb", "max_concurrency",
           "return_routed_experts"}
ROUTE_WIRE_DTYPES = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2"), "uint8": np.dtype("u1")}


class SGLangError(ServerError):
    """An SGLang route failed; the message names the server (when known), the route, the HTTP status
    and the reply's start."""

    kind = "SGLang"


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


def generate_body(request: GenerationRequest, params: SamplingParams,
                  return_routed_experts: bool = False) -> dict[str, Any]:
    """One `/generate` request: token ids in, per-token log-probs of the output only
    (`logprob_start_len=-1`), and the routed experts of every position when asked (the field is
    left out otherwise, so servers that predate it accept the body)."""
    body = {
        "input_ids": list(request.prompt_ids),
        "sampling_params": sampling_params_body(params, request.request_id),
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if return_routed_experts:
        body["return_routed_experts"] = True
    return body


def moe_layer_indices(text_config: PretrainedConfig) -> tuple[int, ...]:
    """The decoder layers that route to experts, by the rules transformers builds them with:
    Qwen2/3-MoE (and the Qwen3-VL/Omni text models) skip `mlp_only_layers` and keep every
    `decoder_sparse_step`-th layer; DeepSeek's first `first_k_dense_replace` layers are dense;
    Mixtral and OLMoE route in every layer."""
    layers = range(text_config.num_hidden_layers)
    step = getattr(text_config, "decoder_sparse_step", None)
    if step:
        dense = set(getattr(text_config, "mlp_only_layers", None) or ())
        return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    return tuple(layers[getattr(text_config, "first_k_dense_replace", None) or 0:])


@dataclass(frozen=True)
class RouteLayout:
    """What `meta_info.routed_experts` must hold for this model: SGLang sends `num_layers` rows
    (every decoder layer) of `top_k` ids per position; rlx keeps the rows of `moe_layers`.
    `num_experts` (None when the config does not say) bounds the ids."""

    num_layers: int
    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int | None

    @classmethod
    def of(cls, config: PretrainedConfig, model: str = "the model") -> RouteLayout:
        text = config.get_text_config()
        top_k = getattr(text, "num_experts_per_tok", None) or 0
        moe_layers = moe_layer_indices(text) if top_k > 0 else ()
        if not moe_layers:
            raise ConfigError(f"routed experts were asked for (rollout.engine_options.return_routed_experts or "
                              f"algorithm.routing_replay=r3), but {model} is not a mixture-of-experts model (its "
                              "config has no num_experts_per_tok or no MoE layer): turn both off")
        experts = next((getattr(text, key) for key in EXPERT_COUNT_KEYS if getattr(text, key, None)), None)
        return cls(text.num_hidden_layers, moe_layers, int(top_k), experts)


def decode_routes(meta: dict[str, Any], positions: int, layout: RouteLayout) -> torch.Tensor:
    """`meta_info.routed_experts` as rlx routes `[positions, MoE layers, top_k]` (`ROUTE_DTYPE`);
    ValueError says what is wrong with it. -1 (`NOT_RECORDED`) passes: the trainer routes those."""
    payload = meta["routed_experts"]
    wire = meta.get("routed_experts_dtype", "int32")
    if wire not in ROUTE_WIRE_DTYPES:
        raise ValueError(f"meta_info.routed_experts_dtype {wire!r} is none of {sorted(ROUTE_WIRE_DTYPES)}")
    dtype = ROUTE_WIRE_DTYPES[wire]
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, TypeError, ValueError) as error:
        raise ValueError(f"meta_info.routed_experts is not base64 ({error})") from None
    per_position = layout.num_layers * layout.top_k
    if len(raw) != positions * per_position * dtype.itemsize:
        raise ValueError(
            f"meta_info.routed_experts holds {len(raw)} bytes, expected {positions} positions (prompt + response - 1)"
            f" x {layout.num_layers} layers x top-{layout.top_k} {wire} = {positions * per_position * dtype.itemsize};"
            " is the server running this model?")
    flat = torch.from_numpy(np.frombuffer(raw, dtype=dtype).astype(np.int64))
    routes = flat.reshape(positions, layout.num_layers, layout.top_k)[:, list(layout.moe_layers)]
    limit = layout.num_experts if layout.num_experts is not None else torch.iinfo(ROUTE_DTYPE).max + 1
    bad = routes[(routes < NOT_RECORDED) | (routes >= limit)]
    if bad.numel():
        raise ValueError(f"meta_info.routed_experts names expert {int(bad[0])}, outside [0, {limit}) for this model"
                         " (SGLang reports physical expert slots when EPLB's redundant experts are on: turn them off)")
    return routes.to(ROUTE_DTYPE)


def entry_problem(entry: Any, vocab_size: int | None) -> str | None:
    """Why one `output_token_logprobs` entry cannot be trained on, or None when it can."""
    if not (isinstance(entry, (list, tuple)) and len(entry) >= 2
            and isinstance(entry[0], (int, float)) and not isinstance(entry[0], bool)
            and isinstance(entry[1], int) and not isinstance(entry[1], bool)):
        return f"output_token_logprobs entry {entry!r} is not [logprob, token_id, text]"
    problem = token_problem(entry[0], entry[1], vocab_size)
    return None if problem is None else f"output_token_logprobs {problem}"


def result_from_response(request: GenerationRequest, reply: Any, weight_version: int,
                         vocab_size: int | None = None, server: str = "",
                         routes: RouteLayout | None = None) -> GenerationResult:
    """A `/generate` reply as a GenerationResult. Token ids and log-probs both come from
    `meta_info.output_token_logprobs` (`[logprob, token_id, text]` per token), which pairs them
    and includes the final stop token; `weight_version` is the version the request was sent under.
    Each entry is checked (`entry_problem`) against `vocab_size`. With `routes` (the request asked
    for routed experts) `meta_info.routed_experts` must be there and fit it (`decode_routes`)."""

    def malformed(why: str) -> SGLangError:
        return SGLangError("/generate", 200, f"malformed reply ({why}): {excerpt(json.dumps(reply))}", server)

    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    if not isinstance(meta, dict):
        raise malformed("no meta_info")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "abort":
        raise SGLangError("/generate", 200, f"request {request.request_id} was aborted: {finish.get('message')}",
                          server)
    if kind not in ("stop", "length"):
        raise malformed(f"finish_reason {finish!r}")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise malformed("no output_token_logprobs")
    logprobs, token_ids = [], []
    for entry in entries:
        problem = entry_problem(entry, vocab_size)
        if problem is not None:
            raise malformed(problem)
        logprobs.append(float(entry[0]))
        token_ids.append(entry[1])
    routed_experts = None
    if routes is not None:
        if meta.get("routed_experts") is None:
            raise SGLangError("/generate", 200, "the reply has no meta_info.routed_experts although the request set "
                              "return_routed_experts: start the SGLang server with --enable-return-routed-experts",
                              server)
        try:
            routed_experts = decode_routes(meta, len(request.prompt_ids) + len(token_ids) - 1, routes)
        except ValueError as error:
            raise malformed(str(error)) from None
    return GenerationResult(
        request_id=request.request_id,
        prompt_ids=list(request.prompt_ids),
        response_ids=token_ids,
        logprobs=logprobs,
        finish_reason=kind,
        weight_version=weight_version,
        extra={"last_weight_version": parse_version(meta.get("weight_version"), weight_version)},
        routed_experts=routed_experts,
    )


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


class SGLangEngine(ServerEngine):
    """The generation-engine interface over one SGLang server (see the module docstring)."""

    error = SGLangError

    def __init__(self, url: str, timeout_s: float = 600.0, max_concurrency: int = 64, tp_size: int = 1,
                 weight_chunk_mb: float = 512.0, api_key: str | None = None, vocab_size: int | None = None,
                 routes: RouteLayout | None = None) -> None:
        """`routes`: ask for every result's routed experts, which must fit this layout."""
        super().__init__(url, timeout_s, max_concurrency, api_key)
        self.routes = routes
        self.tp_size = tp_size
        self.weight_chunk_bytes = max(1, int(weight_chunk_mb * 2**20))
        self.vocab_size = vocab_size
        self._group: WeightGroup | None = None
        self._group_name = ""
        self.weight_version = parse_version(self.model_info().get("weight_version"), 0)

    def model_info(self) -> dict[str, Any]:
        return self._call("GET", "/get_model_info")

    def _generate_one(self, request: GenerationRequest, params: SamplingParams) -> GenerationResult:
        version = self.weight_version
        reply = self._call("POST", "/generate", generate_body(request, params, self.routes is not None))
        return result_from_response(request, reply, version, self.vocab_size, self.url, self.routes)

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
        store = serve_store(master_address, self.timeout_s, master_port)  # listens on master_address only
        joined = in_background(lambda: process_group(store, group_name, backend, 0, world_size, timeout,
                                                      master_address))
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
        sent = in_background(lambda: broadcast_tensors(group, tensors))
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
    from the same folder locally. `dtype`, `device` and `seed` belong to the server's own launch.
    Routed experts are asked for when `return_routed_experts` or `spec.record_routes` (R3) says so."""
    options = dict(spec.options)
    unknown = set(options) - OPTIONS
    if unknown:
        raise ConfigError(f"unknown sglang engine_options {sorted(unknown)}; known: {sorted(OPTIONS)}")
    if not options.get("url"):
        raise ConfigError("rollout.engine=sglang needs rollout.engine_options.url (e.g. http://127.0.0.1:30000)")
    return_routed_experts = options.get("return_routed_experts", False)
    if not isinstance(return_routed_experts, bool):
        raise ConfigError(f"rollout.engine_options.return_routed_experts={return_routed_experts!r}: give true or false")
    tokenizer = load_tokenizer(spec.path)
    routes = None
    if return_routed_experts or spec.record_routes:
        routes = RouteLayout.of(AutoConfig.from_pretrained(spec.path), str(spec.path))
    engine = SGLangEngine(
        options["url"],
        timeout_s=float(options.get("timeout_s", 600.0)),
        max_concurrency=int(options.get("max_concurrency", spec.max_batch_size)),
        tp_size=int(options.get("tp_size", 1)),
        weight_chunk_mb=float(options.get("weight_chunk_mb", 512.0)),
        api_key=api_key_from(options),
        vocab_size=vocab_size(spec.path, tokenizer),
        routes=routes,
    )
    return engine, tokenizer
