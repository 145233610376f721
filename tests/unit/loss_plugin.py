"""A user's policy losses, registered on import: `algorithm.loss.name=tests.unit.loss_plugin:scaled_pg`."""

from __future__ import annotations

import torch

from rlx.algorithms import POLICY_LOSSES, LossInputs, LossTerms
from rlx.config import CustomLoss


@POLICY_LOSSES.register("scaled_pg")
def scaled_pg(x: LossInputs, config: CustomLoss) -> LossTerms:
    """Plain policy gradient, -scale * A * log pi, with `scale` from algorithm.loss.options."""
    loss = -config.options.get("scale", 1.0) * x.advantages * x.logprobs
    return LossTerms(loss, torch.zeros_like(loss))


SEEN: list[LossInputs] = []  # what `recording` was called with, for a test to look at


@POLICY_LOSSES.register("recording")
def recording(x: LossInputs, config: CustomLoss) -> LossTerms:
    """`scaled_pg`, keeping its inputs in SEEN."""
    SEEN.append(x)
    return scaled_pg(x, config)
