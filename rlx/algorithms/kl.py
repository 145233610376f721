"""Per-token estimators of KL(policy || reference) from sampled-token log-probs (Schulman's k1/k2/k3)."""

from __future__ import annotations

import torch


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r, with log r = logp - ref_logp."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"algorithm.kl_type={kind!r} is unknown; use k1, k2 or k3")
