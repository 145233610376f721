"""Samples -> a TokenBatch for the training engine."""

from __future__ import annotations

import torch

from rlx.data.sample import Sample
from rlx.engines.training.batch import TokenBatch, collate


def samples_to_batch(samples: list[Sample], pad_token_id: int, per_token: dict[str, list[list[float]]] | None = None,
                     ) -> TokenBatch:
    return collate(
        prompts=[s.prompt_ids for s in samples],
        responses=[s.response_ids for s in samples],
        pad_token_id=pad_token_id,
        loss_masks=[s.loss_mask if s.loss_mask is not None else [1.0] * len(s.response_ids) for s in samples],
        per_token=per_token,
        routes=_routes(samples),
        media=[s.forward_media for s in samples],
    )


def _routes(samples: list[Sample]) -> list[torch.Tensor] | None:
    """Each sample's recorded experts when any sample has them (MoE, R3); a sample without them is
    routed by the model itself."""
    recorded = next((s.routed_experts for s in samples if s.routed_experts is not None), None)
    if recorded is None:
        return None
    empty = recorded.new_empty((0, *recorded.shape[1:]))
    return [s.routed_experts if s.routed_experts is not None else empty for s in samples]
