"""Generation engines share one interface (`GenerationEngine`).

`GENERATION_ENGINES` (defined in `rlx.generation_engines`, which imports no engine) maps
`rollout.engine` names to factories. A factory takes an `EngineSpec` and returns
`(engine, tokenizer)`; each backend is imported only when it is used, so `vllm` and `sglang` cost
nothing to users of `hf`. Users register their own with `GENERATION_ENGINES.register("name")`.
`EngineLoop` (in `engine_loop`) runs one engine on a thread of its own for callers that submit
requests one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlx.engines.generation.base import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams
from rlx.generation_engines import GENERATION_ENGINES, EngineFactory


@dataclass(frozen=True)
class EngineSpec:
    """What every backend needs to start: a Hugging Face folder and how to run it."""

    path: Path
    dtype: str = "float32"
    device: str = "cpu"
    max_batch_size: int = 64
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # backend-specific (`rollout.engine_options`)
    record_routes: bool = False  # MoE: return each result's `routed_experts` (R3)


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
