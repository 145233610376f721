"""Rollout: prompt groups in, one Sample per response out, streamed as each finishes."""

from __future__ import annotations

import itertools
from typing import Iterator

from transformers import PreTrainedTokenizerBase

from rlx.data.rows import PromptRow
from rlx.data.sample import Sample
from rlx.engines.generation.base import GenerationEngine, GenerationRequest, SamplingParams


class Rollout:
    def __init__(self, engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._uids = itertools.count()

    def generate(
        self, groups: list[tuple[int, PromptRow, list[int]]], n: int, params: SamplingParams
    ) -> Iterator[Sample]:
        """`groups` holds (group_id, row, prompt_ids); each is sampled `n` times."""
        requests, owners = [], {}
        for group_id, row, prompt_ids in groups:
            for _ in range(n):
                uid = next(self._uids)
                requests.append(GenerationRequest(request_id=uid, prompt_ids=prompt_ids))
                owners[uid] = (group_id, row)
        for result in self.engine.stream(requests, params):
            group_id, row = owners[result.request_id]
            yield Sample(
                uid=result.request_id,
                group_id=group_id,
                prompt_ids=result.prompt_ids,
                response_ids=result.response_ids,
                rollout_logprobs=result.logprobs,
                behavior_version=result.weight_version,
                finish_reason=result.finish_reason,
                response_text=self.tokenizer.decode(result.response_ids, skip_special_tokens=True),
                label=row.label,
                metadata=row.metadata,
            )

    def load_weights(self, state_dict, version: int) -> None:
        self.engine.load_weights(state_dict, version)
