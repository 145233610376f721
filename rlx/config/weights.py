"""The `weights` section: how the Actor's weights reach the engines (DCS)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlx.config.base import Section


class WeightsConfig(Section):
    """Weight sync (DCS) from the Actor to the generation engines and ActorFwd (async mode)."""

    channel: Literal["object-store", "gloo", "nccl"] = Field(
        "object-store", description="object-store (Ray, any node), gloo (CPU broadcast) or nccl (GPU broadcast)")
    bucket_mb: float = Field(256, gt=0, description="weights travel in buckets of at most this size")
    timeout_s: float = Field(120, gt=0, description="longest wait for a weight version or a broadcast peer")
