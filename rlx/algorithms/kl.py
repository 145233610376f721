"""Per-token KL terms against a reference, from sampled-token log-probs (Schulman's k1/k2/k3).

Their values estimate KL(pi || pi_ref) on samples from pi; as loss terms their expected gradients
differ (log r = log pi - log pi_ref):
- k1 = log r: zero in expectation (the term adds only noise);
- k2 = (log r)^2 / 2: the gradient of the reverse KL(pi || pi_ref);
- k3 = exp(-log r) - 1 + log r, and low_var (k3 clamped): the gradient of the forward KL(pi_ref || pi);
- k3_ratio = k3 * pi / pi_old with the ratio differentiable (TRL's default, `use_bias_correction_kl`):
  on-policy (pi_old = sg(pi)) the gradient of the reverse KL, like k2, with k3's value.
"""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var", "k3_ratio")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3",
                old_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token KL term `kind`; k3_ratio needs `old_logprobs` (the PPO ratio's denominator;
    None: the current log-probs, detached). low_var clamps k3 to [0, 10] so one token far from the
    reference cannot dominate."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind not in ("k3", "low_var", "k3_ratio"):
        raise ValueError(f"algorithm.kl_type={kind!r} is unknown; use one of {', '.join(KL_TYPES)}")
    k3 = torch.exp(-log_ratio) - 1.0 + log_ratio
    if kind == "low_var":
        return k3.clamp(min=0.0, max=10.0)
    if kind == "k3_ratio":
        old = logprobs.detach() if old_logprobs is None else old_logprobs
        return k3 * torch.exp(logprobs - old)
    return k3
