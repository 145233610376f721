"""Generation engines share one interface (`GenerationEngine`).

`GENERATION_ENGINES` (defined in `rlx.generation_engines`, which imports no engine) maps
`rollout.engine` names to factories. A factory takes an `EngineSpec` and returns
`(engine, tokenizer)`; each backend is imported only when it is used, so `vllm` and `sglang` cost
nothing to users of `hf`. Users register their own with `GENERATION_ENGINES.register("name")`.
`EngineLoop` (in `engine_loop`) runs one engine on a thread of its own for callers that submit
requests one at a time.
"""

from __future__ import annotations

from typing import Any

from rlx.engines.generation.base import (
    EngineSpec,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from rlx.generation_engines import GENERATION_ENGINES, EngineFactory


def build_generation_engine(kind: str, spec: EngineSpec) -> tuple[GenerationEngine, Any]:
    """`(engine, tokenizer)` for `rollout.engine=kind`."""
    return GENERATION_ENGINES.get(kind)(spec)


__all__ = [
    "GENERATION_ENGINES",
    "EngineFactory",
    "EngineSpec",
    "GenerationEngine",
    "GenerationRequest",
    "GenerationResult",
    "SamplingParams",
    "build_generation_engine",
]
