"""Loss aggregation with global normalisers, so micro-batching never changes the loss.

Each micro-batch returns its share of the global mean: summing the shares over micro-batches gives
exactly the full-batch value.
"""

from __future__ import annotations

import torch


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: float, global_sequences: float,
    horizon: float = 1024.0,
) -> torch.Tensor:
    """token-mean: sum(v*m) / global_tokens. seq-mean-token-mean: sum_i(mean_t v_it) / global_sequences.
    seq-mean-token-sum: sum_i(sum_t v_it / horizon) / global_sequences, a constant per-token weight
    that does not depend on the response length (Dr.GRPO)."""
    if mode == "token-mean":
        return (values * mask).sum() / max(global_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_sequence = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_sequence.sum() / max(global_sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return (values * mask).sum() / horizon / max(global_sequences, 1.0)
    raise ValueError(f"algorithm.aggregation={mode!r} is unknown; use token-mean, seq-mean-token-mean "
                     "or seq-mean-token-sum")
