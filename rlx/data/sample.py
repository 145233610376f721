"""A Sample: one response to one prompt, with every field the roles add to it along the way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    uid: int
    group_id: int  # the prompt's position in the data stream; the n responses share it
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    behavior_version: int
    finish_reason: str
    response_text: str
    label: str
    metadata: dict[str, Any] = field(default_factory=dict)
    loss_mask: list[float] | None = None
    reward: float | None = None
    reward_error: str | None = None
    advantage: float | None = None
