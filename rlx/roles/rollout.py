"""Rollout: prompt groups in, one Sample per response out, streamed as each finishes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from rlx.data.rows import PromptRow
from rlx.data.sample import Sample
from rlx.engines.generation.base import GenerationEngine, GenerationRequest, SamplingParams
from rlx.obs.timeline import SPANS

if TYPE_CHECKING:  # transformers costs seconds to import; services without a model skip it
    from transformers import PreTrainedTokenizerBase

Group = tuple[int, PromptRow, list[int]]  # (group id, prompt row, prompt token ids)


class Rollout:
    def __init__(self, engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._uids = itertools.count()

    def generate(
        self,
        groups: list[Group],
        n: int,
        params: SamplingParams,
        more_groups: Callable[[int], list[Group]] | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> Iterator[Sample]:
        """Sample each group `n` times; yield every Sample as soon as it finishes.

        `more_groups(max_groups)` lets the engine pull new groups into free batch slots
        (continuous batching across steps in async mode).
        """
        owners: dict[int, tuple[int, PromptRow]] = {}

        def requests_for(new_groups: list[Group]) -> list[GenerationRequest]:
            out = []
            for group_id, row, prompt_ids in new_groups:
                for _ in range(n):
                    uid = next(self._uids)
                    out.append(GenerationRequest(request_id=uid, prompt_ids=prompt_ids))
                    owners[uid] = (group_id, row)
            return out

        refill = None
        if more_groups is not None:
            refill = lambda free_slots: requests_for(more_groups(free_slots // n))
        for result in self.engine.stream(requests_for(groups), params, refill=refill, between_steps=between_steps):
            group_id, row = owners.pop(result.request_id)
            yield Sample(
                uid=result.request_id,
                group_id=group_id,
                prompt_ids=result.prompt_ids,
                response_ids=result.response_ids,
                rollout_logprobs=result.logprobs,
                behavior_version=result.weight_version,
                last_behavior_version=result.extra.get("last_weight_version", result.weight_version),
                finish_reason=result.finish_reason,
                response_text=self.tokenizer.decode(result.response_ids, skip_special_tokens=True),
                prompt_text=row.question,
                label=row.label,
                metadata=row.metadata,
                routed_experts=result.routed_experts,
            )

    @property
    def version(self) -> int:
        """The weight version the engine generates with."""
        return self.engine.weight_version

    def load_weights(self, state_dict, version: int, shared: bool = False) -> None:
        with SPANS.span("load_weights", "rollout", version=version):
            self.engine.load_weights(state_dict, version, shared)
