"""Loss aggregation with global normalisers, so micro-batching never changes the loss.

Each micro-batch returns its share of the global mean: summing the shares over micro-batches gives
exactly the full-batch value.
"""

from __future__ import annotations

import torch


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: float, global_sequences: float
) -> torch.Tensor:
    """token-mean: sum(v*m) / global_tokens. seq-mean-token-mean: sum_i(mean_t v_it) / global_sequences."""
    if mode == "token-mean":
        return (values * mask).sum() / max(global_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_sequence = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_sequence.sum() / max(global_sequences, 1.0)
    raise ValueError(f"algorithm.aggregation={mode!r} is unknown; use token-mean or seq-mean-token-mean")
