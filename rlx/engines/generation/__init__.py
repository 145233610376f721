"""Generation engines share one interface (`GenerationEngine`).

`GENERATION_ENGINES` maps `rollout.engine` names to factories. A factory takes an `EngineSpec` and
returns `(engine, tokenizer)`; each backend is imported only when it is used, so `vllm` and
`sglang` cost nothing to users of `hf`. Users register their own with
`GENERATION_ENGINES.register("name")`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlx.engines.generation.base import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams
from rlx.registry import Registry


@dataclass(frozen=True)
class EngineSpec:
    """What every backend needs to start: a Hugging Face folder and how to run it."""

    path: Path
    dtype: str = "float32"
    device: str = "cpu"
    max_batch_size: int = 64
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # backend-specific (`rollout.engine_options`)


EngineFactory = Callable[[EngineSpec], tuple[GenerationEngine, Any]]
GENERATION_ENGINES: Registry[EngineFactory] = Registry("generation engine")


@GENERATION_ENGINES.register("hf")
def _build_hf(spec: EngineSpec):
    from rlx.engines.generation.hf import HFGenerationEngine
    from rlx.models import eos_token_ids, load_pretrained

    model, tokenizer = load_pretrained(spec.path, spec.dtype, spec.device)
    engine = HFGenerationEngine(model, pad_token_id=tokenizer.pad_token_id,
                                eos_token_ids=eos_token_ids(model, tokenizer), tokenizer=tokenizer,
                                max_batch_size=spec.max_batch_size)
    return engine, tokenizer


@GENERATION_ENGINES.register("vllm")
def _build_vllm(spec: EngineSpec):
    from rlx.engines.generation.vllm import build_vllm_engine

    return build_vllm_engine(spec)


@GENERATION_ENGINES.register("sglang")
def _build_sglang(spec: EngineSpec):
    from rlx.engines.generation.sglang import build_sglang_engine

    return build_sglang_engine(spec)


def build_generation_engine(kind: str, spec: EngineSpec):
    """`(engine, tokenizer)` for `rollout.engine=kind`."""
    return GENERATION_ENGINES.get(kind)(spec)


__all__ = ["EngineSpec", "GENERATION_ENGINES", "GenerationEngine", "GenerationRequest", "GenerationResult",
           "SamplingParams", "build_generation_engine"]
