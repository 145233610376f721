"""Rollout: prompt groups in, one Sample per response out, streamed as each finishes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from rlx.data.rows import DataError, PromptRow
from rlx.data.sample import Sample
from rlx.engines.generation.base import GenerationEngine, GenerationRequest, SamplingParams
from rlx.media.inputs import MediaInputs
from rlx.obs.timeline import SPANS

if TYPE_CHECKING:  # transformers costs seconds to import; services without a model skip it
    from transformers import PreTrainedTokenizerBase

    from rlx.media.processor import MediaProcessor

Group = tuple[int, PromptRow, list[int]]  # (group id, prompt row, prompt token ids)


class Rollout:
    def __init__(self, engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase,
                 processor: MediaProcessor | None = None) -> None:
        """`processor`: turns a row's media into model inputs (multimodal models), once per group."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.processor = processor
        self._uids = itertools.count()

    @property
    def placeholder_text(self) -> dict[str, str]:
        """Dataset placeholder (`<image>`) -> the model's placeholder token, for prompt encoding."""
        if self.processor is None:
            return {}
        return {f"<{kind}>": self.tokenizer.convert_ids_to_tokens(token)
                for kind, token in self.processor.placeholder_ids.items()}

    def prepare(self, row: PromptRow, prompt_ids: list[int]) -> tuple[list[int], MediaInputs | None]:
        """The prompt as the engine takes it: media placeholders expanded, media as model inputs."""
        if not row.media:
            return prompt_ids, None
        if self.processor is None:
            raise DataError(f"{row.source}: the row carries media but the rollout has no media processor "
                            "(set data.media_keys and use a model that takes media)")
        return self.processor(prompt_ids, row)

    def prepare_all(self, items: list[tuple[PromptRow, list[int]]]) -> list[tuple[list[int], MediaInputs | None]]:
        """`prepare` for each (row, prompt_ids), in order; the rows with media in parallel when the
        processor is a pool (`data.processor_workers`)."""
        parallel = getattr(self.processor, "map", None)
        media_rows = [i for i, (row, _) in enumerate(items) if row.media]
        if parallel is None or len(media_rows) < 2:
            return [self.prepare(row, prompt_ids) for row, prompt_ids in items]
        out: list[tuple[list[int], MediaInputs | None]] = [(prompt_ids, None) for _, prompt_ids in items]
        for i, prepared in zip(media_rows, parallel([(items[i][1], items[i][0]) for i in media_rows])):
            out[i] = prepared
        return out

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
        owners: dict[int, tuple[int, PromptRow, MediaInputs | None]] = {}

        def requests_for(new_groups: list[Group]) -> list[GenerationRequest]:
            out = []
            prepared = self.prepare_all([(row, prompt_ids) for _, row, prompt_ids in new_groups])
            for (group_id, row, _), (prompt_ids, media) in zip(new_groups, prepared):  # once per group: shared
                for _ in range(n):
                    uid = next(self._uids)
                    out.append(GenerationRequest(request_id=uid, prompt_ids=prompt_ids, media=media))
                    owners[uid] = (group_id, row, media)
            return out

        refill = None
        if more_groups is not None:
            refill = lambda free_slots: requests_for(more_groups(free_slots // n))
        for result in self.engine.stream(requests_for(groups), params, refill=refill, between_steps=between_steps):
            group_id, row, media = owners.pop(result.request_id)
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
                media_inputs=media,
            )

    @property
    def version(self) -> int:
        """The weight version the engine generates with."""
        return self.engine.weight_version

    def load_weights(self, state_dict, version: int, shared: bool = False) -> None:
        with SPANS.span("load_weights", "rollout", version=version):
            self.engine.load_weights(state_dict, version, shared)
