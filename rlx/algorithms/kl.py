"""Per-token estimators of KL(policy || reference) from sampled-token log-probs (Schulman's k1/k2/k3)."""

from __future__ import annotations

import torch


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r, with log r = logp - ref_logp;
    low_var is k3 clamped to [0, 10] so one token far from the reference cannot dominate."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    if kind == "low_var":
        return (torch.exp(-log_ratio) - 1.0 + log_ratio).clamp(min=0.0, max=10.0)
    raise ValueError(f"algorithm.kl_type={kind!r} is unknown; use k1, k2, k3 or low_var")
