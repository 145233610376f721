"""Generation engines share one interface (`GenerationEngine`); `hf` is built in."""

from __future__ import annotations

from rlx.engines.generation.base import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams


def build_generation_engine(kind: str, **kwargs) -> GenerationEngine:
    if kind == "hf":
        from rlx.engines.generation.hf import HFGenerationEngine

        return HFGenerationEngine(**kwargs)
    raise ValueError(f"rollout.engine={kind!r} is not a known generation engine; use 'hf'")


__all__ = ["GenerationEngine", "GenerationRequest", "GenerationResult", "SamplingParams", "build_generation_engine"]
