"""The names `rollout.engine` accepts, each with a factory that imports its backend only when called.

This module imports no engine, so `rlx.config` can check `rollout.engine` against it without
importing torch, vllm or sglang. `rlx.engines.generation` re-exports `GENERATION_ENGINES`; users
register their own backend with `GENERATION_ENGINES.register("name")` before the config is loaded.
A factory takes an `EngineSpec` and returns `(engine, tokenizer)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlx.registry import Registry

if TYPE_CHECKING:
    from rlx.engines.generation import EngineSpec, GenerationEngine

EngineFactory = Callable[["EngineSpec"], tuple["GenerationEngine", Any]]
GENERATION_ENGINES: Registry[EngineFactory] = Registry("generation engine")


@GENERATION_ENGINES.register("hf")
def _build_hf(spec: EngineSpec) -> tuple[GenerationEngine, Any]:
    from rlx.engines.generation.hf import HFGenerationEngine
    from rlx.models import eos_token_ids, load_pretrained

    model, tokenizer = load_pretrained(spec.path, spec.dtype, spec.device)
    engine = HFGenerationEngine(model, pad_token_id=tokenizer.pad_token_id,
                                eos_token_ids=eos_token_ids(model, tokenizer), tokenizer=tokenizer,
                                max_batch_size=spec.max_batch_size, record_routes=spec.record_routes)
    return engine, tokenizer


@GENERATION_ENGINES.register("vllm")
def _build_vllm(spec: EngineSpec) -> tuple[GenerationEngine, Any]:
    from rlx.engines.generation.vllm import build_vllm_engine

    return build_vllm_engine(spec)


@GENERATION_ENGINES.register("sglang")
def _build_sglang(spec: EngineSpec) -> tuple[GenerationEngine, Any]:
    from rlx.engines.generation.sglang import build_sglang_engine

    return build_sglang_engine(spec)
