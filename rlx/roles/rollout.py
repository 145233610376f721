"""Rollout: prompt groups in, one Sample per response out, streamed as each finishes."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from rlx.data.rows import DataError, PromptRow
from rlx.data.sample import Sample
from rlx.engines.generation.base import GenerationEngine, GenerationRequest, SamplingParams
from rlx.media.inputs import MediaInputs
from rlx.obs.timeline import SPANS
from rlx.rewards.safe import ROLLOUT_ERROR, bounded

if TYPE_CHECKING:  # transformers costs seconds to import; services without a model skip it
    from transformers import PreTrainedTokenizerBase

    from rlx.media.processor import MediaProcessor

Group = tuple[int, PromptRow, list[int]]  # (group id, prompt row, prompt token ids)
Prepared = tuple[list[int], "MediaInputs | None"]  # the prompt as the engine takes it, and its media
log = logging.getLogger(__name__)


def _taken(samples: list[Sample]) -> list[Sample]:
    """Everything in `samples`, which is emptied."""
    taken = samples[:]
    samples.clear()
    return taken


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

    def prepare_all(self, items: list[tuple[PromptRow, list[int]]]) -> list[Prepared | DataError]:
        """`prepare` for each (row, prompt_ids), in order; the rows with media in parallel when the
        processor is a pool (`data.processor_workers`). A row whose media the processor refuses (a
        file that will not decode) gives its DataError in its place: only its group fails."""
        parallel = getattr(self.processor, "map", None)
        media_rows = [i for i, (row, _) in enumerate(items) if row.media]
        if parallel is not None and len(media_rows) >= 2:
            try:
                out: list[Prepared | DataError] = [(prompt_ids, None) for _, prompt_ids in items]
                for i, prepared in zip(media_rows, parallel([(items[i][1], items[i][0]) for i in media_rows])):
                    out[i] = prepared
                return out
            except DataError:  # a row's media failed: each row once more on its own, so only it fails
                pass
        return [self._prepared(row, prompt_ids) for row, prompt_ids in items]

    def _prepared(self, row: PromptRow, prompt_ids: list[int]) -> Prepared | DataError:
        try:
            return self.prepare(row, prompt_ids)
        except DataError as error:
            return error

    def failed_group(self, group_id: int, row: PromptRow, prompt_ids: list[int], n: int,
                     error: DataError) -> list[Sample]:
        """The n samples of a group whose media would not decode: no response, the reason in
        `metadata.rollout_error`, so no reward scores them and each fails (reward_failed_bad_media),
        counted and never trained on; at the engine's version, so they count as on time."""
        log.warning("a group's media failed; its %d samples fail: %s", n, error)
        failure = {ROLLOUT_ERROR: {"kind": "bad_media", "error": bounded(str(error))}}
        version = self.engine.weight_version
        return [Sample(uid=next(self._uids), group_id=group_id, prompt_ids=prompt_ids, behavior_version=version,
                       last_behavior_version=version, finish_reason="bad_media", prompt_text=row.question,
                       label=row.label, metadata={**row.metadata, **failure}) for _ in range(n)]

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
        failed: list[Sample] = []  # the samples of groups whose media failed, yielded as soon as can be

        def requests_for(new_groups: list[Group]) -> list[GenerationRequest]:
            out = []
            prepared = self.prepare_all([(row, prompt_ids) for _, row, prompt_ids in new_groups])
            for (group_id, row, raw_ids), ready in zip(new_groups, prepared):  # once per group: shared
                if isinstance(ready, DataError):
                    failed.extend(self.failed_group(group_id, row, raw_ids, n, ready))
                    continue
                prompt_ids, media = ready
                for _ in range(n):
                    uid = next(self._uids)
                    out.append(GenerationRequest(request_id=uid, prompt_ids=prompt_ids, media=media))
                    owners[uid] = (group_id, row, media)
            return out

        refill = None
        if more_groups is not None:
            refill = lambda free_slots: requests_for(more_groups(free_slots // n))
        for result in self.engine.stream(requests_for(groups), params, refill=refill, between_steps=between_steps):
            yield from _taken(failed)
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
        yield from _taken(failed)

    @property
    def version(self) -> int:
        """The weight version the engine generates with."""
        return self.engine.weight_version

    def load_weights(self, state_dict, version: int, shared: bool = False) -> None:
        with SPANS.span("load_weights", "rollout", version=version):
            self.engine.load_weights(state_dict, version, shared)
