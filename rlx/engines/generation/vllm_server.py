"""`rollout.engine=vllm` with `engine_options.url`: drive a vLLM server that already runs.

Tokens in, tokens out: `POST /inference/v1/generate` takes the prompt's token ids and answers the
sampled ids with their log-probs (`logprobs: 0`, the sampled token's only) and the weight versions
that sampled them. New weights go through vLLM's online RL API (`/pause?mode=keep`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update` with the version, `/resume`):
vLLM preempts the requests in flight and clears its KV and prefix caches, so they go on under the
new weights with their tokens so far recomputed (the in-process engines keep the old KV instead;
the reply's version spans say which weights sampled which tokens). The bytes travel by broadcast in a gloo group this client hosts (rank 0) and
the server's workers join (`rlx_gloo`, `rlx/engines/generation/vllm_transfer.py`), one group
formed at the first load and reused.

The server must run with what this needs, checked at start with errors that say how:
- `VLLM_SERVER_DEV_MODE=1` (vLLM serves the RL API only then) and `--enable-scale-out` (the
  token-in/token-out route). Dev mode's routes (weights, pause, `collective_rpc`) take no API key
  whatever `--api-key` says: bind the server to loopback or a trusted network (`--host`);
- the run's `rollout.dtype` (`--dtype`; vLLM's `auto` runs a float32 checkpoint in bfloat16 on
  CPU), as the trainer's log-probs are compared with the server's;
- `--weight-transfer-config '{"backend": "rlx_gloo"}'`, with rlx installed beside vLLM (its plugin
  registers the backend);
- `--logprobs-mode processed_logprobs`: log-probs of the temperature-scaled distribution, the
  quantity the trainer computes (vLLM's default, `raw_logprobs`, ignores the temperature).
Top-k/top-p are refused: a server's processed log-probs are taken after that filter renormalises.

`rollout.engine_options`: `url` (required), `timeout_s` (per HTTP call and for the group,
default 600), `max_concurrency` (requests in flight, default `max_batch_size`), `weight_chunk_mb`
(largest update announced at once; the server holds that much beside its weights, default 512),
`weight_host` (the address the server reaches this process at for the broadcast; default
127.0.0.1 for a server on loopback, else `$RLX_WEIGHTS_HOST` or this Ray node's address), and the
server's `--api-key` as `api_key_env` (preferred) or `api_key`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from datetime import timedelta
from typing import Any

import torch

from rlx.engines.generation.base import EngineSpec, GenerationRequest, GenerationResult, SamplingParams
from rlx.engines.generation.server_client import (
    MAX_GROUP_TIMEOUT_S,
    ServerEngine,
    ServerError,
    WeightGroup,
    api_key_from,
    broadcast_tensors,
    dtype_name,
    excerpt,
    in_background,
    is_loopback,
    parse_version,
    process_group,
    tensor_chunks,
    token_problem,
    vocab_size,
)
from rlx.engines.generation.vllm_common import meta_model, sampling_fields
from rlx.errors import ConfigError
from rlx.models import load_tokenizer
from rlx.weights.broadcast import rendezvous_host, serve_store

OPTIONS = {"url", "api_key", "api_key_env", "timeout_s", "max_concurrency", "weight_chunk_mb", "weight_host"}
TRANSFER_BACKEND = "rlx_gloo"
logger = logging.getLogger(__name__)
MISSING_LOGPROB = -9999.0  # what vLLM writes for a NaN, -inf or absent log-prob
SERVED_DTYPES = ("float32", "bfloat16", "float16")
LAUNCH_HINT = ("start it as VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --host 127.0.0.1 --enable-scale-out "
               f"--logprobs-mode processed_logprobs --weight-transfer-config '{{\"backend\": \"{TRANSFER_BACKEND}\"}}' "
               "(rlx installed beside vLLM; dev mode's routes take no API key: keep the server off untrusted networks)")


def warn_if_exposed(url: str, weight_host: str) -> None:
    """A dev-mode server off loopback: say what anyone on its network can do."""
    if not is_loopback(url):
        logger.warning("the vLLM server at %s is not on loopback: its dev-mode routes (weights, pause, "
                       "collective_rpc) take no API key, and the weight group's store listens on %s for the run "
                       "(whoever joins it first receives the weights); keep both on a private network", url, weight_host)


class VLLMServerError(ServerError):
    """A vLLM server's route failed."""

    kind = "vLLM"


def result_from_reply(request: GenerationRequest, reply: Any, weight_version: int, vocab: int | None = None,
                      server: str = "") -> GenerationResult:
    """One `/inference/v1/generate` reply as a GenerationResult, every token checked
    (`token_problem`, and vLLM's stand-in for a missing or non-finite log-prob refused). The
    result's version is the one that sampled its first token (the reply's version spans; else
    `weight_version`, the version the request was sent under); the last one that sampled a token
    goes to `extra["last_weight_version"]`."""

    def malformed(why: str) -> VLLMServerError:
        return VLLMServerError("/inference/v1/generate", 200, f"malformed reply ({why}): {excerpt(str(reply))}", server)

    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not (isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict)):
        raise malformed("not one choice")
    choice = choices[0]
    finish = choice.get("finish_reason")
    if finish == "abort":
        raise VLLMServerError("/inference/v1/generate", 200, f"request {request.request_id} was aborted", server)
    if finish not in ("stop", "length"):
        raise malformed(f"finish_reason {finish!r}")
    token_ids = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if not (isinstance(token_ids, list) and isinstance(content, list) and len(content) == len(token_ids)):
        raise malformed("token_ids and logprobs.content are not lists of one length")
    logprobs = []
    for token_id, entry in zip(token_ids, content):
        logprob = entry.get("logprob") if isinstance(entry, dict) else None
        problem = token_problem(logprob, token_id, vocab)
        if problem is None and logprob <= MISSING_LOGPROB:
            problem = f"log-prob {logprob!r} of token {token_id} is vLLM's stand-in for a missing or non-finite one"
        if problem is None and entry.get("token_id") != token_id:
            problem = f"log-prob of token {entry.get('token_id')!r} given for sampled token {token_id}"
        if problem is not None:
            raise malformed(problem)
        logprobs.append(float(logprob))
    spans = choice.get("weight_versions") or []
    first, last = ((parse_version(spans[0].get("version"), weight_version),
                    parse_version(spans[-1].get("version"), weight_version)) if spans else (weight_version,) * 2)
    return GenerationResult(
        request_id=request.request_id,
        prompt_ids=list(request.prompt_ids),
        response_ids=list(token_ids),
        logprobs=logprobs,
        finish_reason=finish,
        weight_version=first,
        extra={"last_weight_version": last},
    )


class VLLMServerEngine(ServerEngine):
    """The generation-engine interface over one vLLM server (see the module docstring)."""

    error = VLLMServerError

    def __init__(self, url: str, path: str, timeout_s: float = 600.0, max_concurrency: int = 64,
                 weight_chunk_mb: float = 512.0, weight_host: str | None = None, api_key: str | None = None,
                 vocab: int | None = None, dtype: str | None = None) -> None:
        """`path`: the model's folder here, which names the weights in the checkpoint's layout;
        `dtype`: the one the server must run (None: any), weights are sent in the server's."""

        super().__init__(url, timeout_s, max_concurrency, api_key)
        self.vocab_size = vocab
        self.weight_chunk_bytes = max(1, int(weight_chunk_mb * 2**20))
        self.weight_host = weight_host or ("127.0.0.1" if is_loopback(self.url) else rendezvous_host())
        warn_if_exposed(self.url, self.weight_host)
        self.dtype = self._check_launch(dtype)
        self.weight_version = parse_version(self._call("GET", "/weight_info").get("weight_version"), 0)
        self._meta_model = meta_model(path)
        self._group: WeightGroup | None = None
        self._groups = itertools.count()

    def _check_launch(self, dtype: str | None) -> torch.dtype:
        """The server runs the RL API, the `rlx_gloo` backend, processed log-probs, the token route
        and `dtype`, or a ConfigError says how. Returns the server's dtype."""
        try:
            info = self._call("GET", "/server_info", params={"config_format": "json"})
        except VLLMServerError as error:
            if error.status == 404:
                raise ConfigError(f"the vLLM server at {self.url} does not serve its RL API (GET /server_info: "
                                  f"404): {LAUNCH_HINT}") from None
            raise
        config = info.get("vllm_config") or {}
        mode = (config.get("model_config") or {}).get("logprobs_mode")
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if mode != "processed_logprobs":
            raise ConfigError(f"the vLLM server at {self.url} reports logprobs_mode={mode!r}: the trainer needs the "
                              f"temperature-scaled log-probs; {LAUNCH_HINT}")
        if backend != TRANSFER_BACKEND:
            raise ConfigError(f"the vLLM server at {self.url} loads weights by backend {backend!r}, not "
                              f"{TRANSFER_BACKEND!r}; {LAUNCH_HINT}")
        served = str((config.get("model_config") or {}).get("dtype", "")).removeprefix("torch.")
        if served not in SERVED_DTYPES:
            raise VLLMServerError("/server_info", 200, f"reports dtype {served!r}, not one of {SERVED_DTYPES}", self.url)
        if dtype is not None and served != dtype:
            raise ConfigError(f"the vLLM server at {self.url} runs {served}, the run's rollout.dtype is {dtype}: launch "
                              f"it with --dtype {dtype}, or set rollout.dtype={served}")
        try:
            self._call("POST", "/inference/v1/generate", {"token_ids": [0], "output_mode": "tokens",
                                                          "sampling_params": {"max_tokens": 1}})
        except VLLMServerError as error:
            if error.status in (403, 404):
                raise ConfigError(f"the vLLM server at {self.url} does not serve POST /inference/v1/generate "
                                  f"({error}): {LAUNCH_HINT}") from None
            raise
        return getattr(torch, served)

    def _generate_one(self, request: GenerationRequest, params: SamplingParams) -> GenerationResult:
        if request.media is not None:
            raise ValueError("the vllm engine by URL sends token ids only: media prompts need the hf engine")
        if params.top_k > 0 or params.top_p < 1.0:
            raise ValueError("a vLLM server reports top-k/top-p log-probs renormalised; use top_k=0, top_p=1")
        version = self.weight_version
        reply = self._call("POST", "/inference/v1/generate", {
            "token_ids": list(request.prompt_ids),
            "sampling_params": sampling_fields(params, request.request_id),
            "output_mode": "tokens",
        })
        return result_from_reply(request, reply, version, self.vocab_size, self.url)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int, shared: bool = False) -> None:
        """Pause (vLLM preempts the requests in flight and clears its KV and prefix caches: they go
        on under the new weights, recomputed), send the weights in chunks, stamp the version,
        resume. The names go in the checkpoint's layout (see `VLLMGenerationEngine.load_weights`).

        Between `/start_weight_update` and `/finish_weight_update` the server's layers are being
        replaced, so it is resumed only after an update finished: a failed one is tried once more
        whole, on a new group; if that fails too the server stays paused (part old, part new
        weights) and the error says so: the next load sends every weight again."""
        from transformers.core_model_loading import revert_weight_conversion

        weights = revert_weight_conversion(self._meta_model, state_dict)
        self._call("POST", "/pause", params={"mode": "keep", "clear_cache": "true"})
        try:
            self._update(weights, version)
        except Exception as error:
            error.add_note(f"the vLLM server at {self.url} stays paused: its weights may be part old, part new "
                           "until a later load sends them whole")
            raise
        self._call("POST", "/resume")
        self.weight_version = version

    def _update(self, weights: dict[str, torch.Tensor], version: int, tries: int = 2) -> None:
        """One whole update, tried up to `tries` times; a failure drops the group (its peers may be
        out of step) and closes the server's open update, so the next try starts clean."""
        for attempt in range(1, tries + 1):
            try:
                if self._group is None:
                    self._group = self._join()
                self._call("POST", "/start_weight_update")
                for chunk in tensor_chunks(weights, self.weight_chunk_bytes):
                    self._send(chunk)
                self._call("POST", "/finish_weight_update", {"weight_version": str(version)})
                return
            except Exception:
                self._group = None
                with contextlib.suppress(VLLMServerError):  # no update open (it failed to start): nothing to close
                    self._call("POST", "/finish_weight_update", {})
                if attempt == tries:
                    raise

    def _send(self, chunk: list[tuple[str, torch.Tensor]]) -> None:
        """Announce one chunk's names, dtypes and shapes while broadcasting its tensors in that order."""
        tensors = [tensor.detach().to("cpu", self.dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
                   for _, tensor in chunk]
        group = self._group
        sent = in_background(lambda: broadcast_tensors(group, tensors))
        self._call("POST", "/update_weights", {"update_info": {
            "names": [name for name, _ in chunk],
            "dtype_names": [dtype_name(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
        }})
        sent.result(timeout=self.timeout_s)

    def _join(self) -> WeightGroup:
        """Form the weight group: this process is rank 0 and hosts the store, the server's workers follow."""
        workers = int(self._call("GET", "/get_world_size", params={"include_dp": "true"})["world_size"])
        world_size, name = 1 + workers, f"rlx_weights_{next(self._groups)}"
        timeout = timedelta(seconds=self.timeout_s)
        store = serve_store(self.weight_host, self.timeout_s)
        joined = in_background(lambda: process_group(store, name, "gloo", 0, world_size, timeout, self.weight_host))
        self._call("POST", "/init_weight_transfer_engine", {"init_info": {
            "master_address": self.weight_host, "master_port": store.port, "rank_offset": 1,
            "world_size": world_size, "group_name": name, "timeout_s": min(self.timeout_s, MAX_GROUP_TIMEOUT_S),
        }})
        return joined.result(timeout=self.timeout_s)


def build_vllm_server_engine(spec: EngineSpec) -> tuple[VLLMServerEngine, Any]:
    """`(engine, tokenizer)`: the server at `options["url"]` serves the model; the tokenizer and the
    weight names come from the same folder here. `dtype`, `device` and `seed` belong to the server's launch."""
    options = dict(spec.options)
    unknown = set(options) - OPTIONS
    if unknown:
        raise ConfigError(f"unknown engine_options {sorted(unknown)} for the vllm engine by URL; known: "
                          f"{sorted(OPTIONS)} (vLLM's engine arguments belong to the server's launch)")
    if spec.record_routes:
        raise ConfigError("routing replay (algorithm.routing_replay=r3) is not wired for the vllm engine by URL: "
                          "use the in-process vllm engine, hf, or sglang by URL")
    tokenizer = load_tokenizer(spec.path)
    engine = VLLMServerEngine(
        options["url"], str(spec.path),
        timeout_s=float(options.get("timeout_s", 600.0)),
        max_concurrency=int(options.get("max_concurrency", spec.max_batch_size)),
        weight_chunk_mb=float(options.get("weight_chunk_mb", 512.0)),
        weight_host=options.get("weight_host"),
        api_key=api_key_from(options),
        vocab=vocab_size(spec.path, tokenizer),
        dtype=spec.dtype,
    )
    return engine, tokenizer
