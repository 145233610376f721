"""A Sample: one response to one prompt, with every field the roles add to it along the way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """Every field but the ids has a default: a role rebuilds samples from just the bus fields it reads."""

    uid: int
    group_id: int  # the prompt's position in the data stream; the n responses share it
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    behavior_version: int = 0  # weights the first token was sampled with (staleness counts from it)
    last_behavior_version: int | None = None  # weights of the last token: newer if loaded mid-generation
    finish_reason: str = ""
    response_text: str = ""
    prompt_text: str = ""  # the user's question, for judges (GenRM)
    label: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    loss_mask: list[float] | None = None  # 0 on tokens the policy did not generate (tool results, feedback)
    routed_experts: Any = None  # MoE: the experts the engine chose per position (int16 tensor, rlx.models.moe)
    media_inputs: dict[str, Any] | None = None  # the prompt's media as model inputs: one object per group
    # media a multi-turn trajectory's observations showed (model inputs, one object per observation)
    observed_media: tuple[dict[str, Any], ...] | None = None
    agent_stats: dict[str, Any] | None = None  # multi-turn rollouts: turns, tool calls, masked tokens
    # an episode that made several samples (agent apps): its number within the group, and how many
    episode: int | None = None
    episode_rows: int = 1
    reward: float | None = None
    reward_error: str | None = None
    advantage: float | None = None
    token_advantages: list[float] | None = None  # per-token advantages (GAE, distillation) override `advantage`
    values: list[float] | None = None  # the critic's value of the state before each response token
    returns: list[float] | None = None  # the critic's regression targets
    teacher_logprobs: list[float] | None = None  # the teacher's log-probs of the sampled tokens
    ref_logprobs: list[float] | None = None
    old_logprobs: list[float] | None = None  # proximal policy (ActorFwd), for decoupled PPO
    proximal_version: int | None = None  # the weight version ActorFwd computed `old_logprobs` with
    filter_reason: str | None = None  # why the sample is not trained on, if it is not

    @property
    def forward_media(self) -> Any:
        """The media a forward over the whole sample takes: the prompt's, then what its
        observations showed, as parts in placeholder order (`rlx.media.inputs.RowMedia`)."""
        from rlx.media.inputs import with_shown  # torch: imported only where a forward is built

        return with_shown(self.media_inputs, self.observed_media or ())
