"""The generation-engine interface every backend (hf, vllm, sglang) implements."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from rlx.media.inputs import RowMedia


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


@dataclass(frozen=True)
class SamplingParams:
    """`temperature=0` means greedy. Log-probs are always those of the temperature-scaled,
    unfiltered distribution: the same quantity the training engine computes."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class GenerationRequest:
    request_id: int
    prompt_ids: list[int]
    media: RowMedia | None = None  # the model's media inputs for this prompt: one object or parts (rlx.media)


@dataclass
class GenerationResult:
    request_id: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop token or string) or "length"
    weight_version: int
    extra: dict = field(default_factory=dict)
    routed_experts: torch.Tensor | None = None  # MoE: int16 [len(prompt)+len(response)-1, layers, top_k] (rlx.models.moe)


class GenerationEngine(Protocol):
    weight_version: int

    def stream(self, requests: list[GenerationRequest], params: SamplingParams) -> Iterator[GenerationResult]:
        """Yield each result as soon as its sequence finishes."""

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int, shared: bool = False) -> None:
        """Replace the weights in place and record their version. `shared`: the tensors are an
        immutable snapshot (DCS's read-only object-store views) that the engine may keep as its
        weights instead of copying them."""


class StreamingEngine(abc.ABC):
    """`generate` for every engine that implements `stream`."""

    @abc.abstractmethod
    def stream(self, requests: list[GenerationRequest], params: SamplingParams) -> Iterator[GenerationResult]:
        """Yield each result as soon as its sequence finishes."""

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[GenerationResult]:
        """All results, in request order."""
        order = {r.request_id: i for i, r in enumerate(requests)}
        return sorted(self.stream(requests, params), key=lambda res: order[res.request_id])
