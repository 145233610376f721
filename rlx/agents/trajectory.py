"""A multi-turn trajectory as one token sequence, built token in and token out.

The policy's tokens are appended exactly as the engine generated them, with their log-probs;
observations (tool results, environment feedback, the chat template's turn markers around them)
are tokenised once, appended, and masked out of the loss. Nothing is re-tokenised from text, so
the trainer scores exactly the tokens the engine sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlx.media.inputs import with_shown

if TYPE_CHECKING:  # kept off the import path of an environment process (rlx.agents.env_process) and `rlx doctor`
    import torch

CUT_REASONS = ("length", "max_turns", "max_tokens")  # finish reasons of a trajectory a limit ended


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call of a trajectory, for metrics: which tool, how it ended, how long it took."""

    tool: str
    outcome: str  # ToolResult.outcome: ok, error, timeout, bad_arguments, unknown_tool (or unparsable)
    latency_s: float


@dataclass
class Trajectory:
    """`response_ids` is everything after `prompt_ids`: policy turns and observations interleaved.
    `logprobs` and `loss_mask` run along it (an observation token has log-prob 0 and mask 0)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    turns: int = 0  # policy turns
    behavior_version: int | None = None  # weights of the first policy token
    last_behavior_version: int | None = None  # weights of the last policy token
    finish_reason: str = ""  # stop, length (a turn hit max_new_tokens), max_turns, max_tokens, env_error
    final_text: str = ""  # the last policy turn as text: what the reward reads
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    env_reward: float | None = None  # a reward the environment gave at the end, if it gives one
    env_error: str | None = None  # why the episode failed (an agent app that raised, hung, returned garbage)
    routed_experts: Any = None  # MoE: experts per position, each from the first forward that computed it
    media: Any = None  # the opening prompt's media as model inputs (rlx.media): shared by the group
    observed_media: list[Any] = field(default_factory=list)  # what each observation showed, in order

    @property
    def request_media(self) -> Any:
        """The media of the whole context, sent with every turn's request (each turn prefills it
        all): the opening's, then each observation's, as parts (`rlx.media.inputs.RowMedia`)."""
        return with_shown(self.media, self.observed_media)

    def add_policy(self, ids: list[int], logprobs: list[float], version: int, last_version: int | None = None,
                   routes: torch.Tensor | None = None) -> None:
        """Append one policy turn exactly as generated. `routes` (MoE) cover the turn's whole request:
        positions recorded by earlier turns keep their routes (those forwards made the log-probs),
        the rest (the previous turn's last token, the observation, this turn) are appended."""
        if len(ids) != len(logprobs):
            raise ValueError(f"a policy turn has {len(ids)} tokens but {len(logprobs)} log-probs")
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [1.0] * len(ids)
        self.turns += 1
        if self.behavior_version is None:
            self.behavior_version = version
        self.last_behavior_version = version if last_version is None else last_version
        if routes is not None:
            import torch

            known = 0 if self.routed_experts is None else self.routed_experts.shape[0]
            self.routed_experts = routes if known == 0 else torch.cat([self.routed_experts, routes[known:]])

    def add_observation(self, ids: list[int], media: Any = None) -> None:
        """Append tokens the policy did not generate: they are context, never trained on. `media`:
        the model inputs of the media their placeholders stand for, if they show any."""
        if media:
            self.observed_media.append(media)
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0.0] * len(ids)

    @property
    def context_ids(self) -> list[int]:
        """What the engine continues from for the next turn."""
        return self.prompt_ids + self.response_ids

    @property
    def masked_tokens(self) -> int:
        return sum(1 for m in self.loss_mask if m == 0.0)
