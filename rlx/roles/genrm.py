"""GenRM: a judge LLM on its own generation engine scores responses from a prompt template."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import TYPE_CHECKING

from rlx.data.sample import Sample
from rlx.engines.generation.base import GenerationEngine, GenerationRequest, SamplingParams
from rlx.rewards.judge import JudgeParser

if TYPE_CHECKING:  # transformers costs seconds to import; services without a model skip it
    from transformers import PreTrainedTokenizerBase


class GenRM:
    def __init__(self, engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase, template: str,
                 parse: JudgeParser, max_score: float, params: SamplingParams) -> None:
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        self.parse, self.max_score, self.params = parse, max_score, params
        self._ids = itertools.count()
        self._failures: Counter[str] = Counter()

    @property
    def failures(self) -> dict[str, int]:
        """Failed samples so far, by class (as the Reward role reports them): unparseable verdicts."""
        return dict(self._failures)

    def close(self) -> None:
        """Nothing to release: the judge's engine lives as long as its process (the Reward role's
        counterpart closes a process pool)."""

    def judge_prompt(self, sample: Sample) -> list[int]:
        text = self.template.format(question=sample.prompt_text, response=sample.response_text, label=sample.label)
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                      add_generation_prompt=True, return_dict=False)
        return self.tokenizer(text)["input_ids"]

    def score(self, samples: list[Sample]) -> list[Sample]:
        """One batched generation for all samples; an unparseable verdict fails only its sample."""
        requests = {next(self._ids): s for s in samples}
        batch = [GenerationRequest(request_id=rid, prompt_ids=self.judge_prompt(s)) for rid, s in requests.items()]
        for result in self.engine.stream(batch, self.params):
            sample = requests[result.request_id]
            verdict = self.tokenizer.decode(result.response_ids, skip_special_tokens=True)
            try:
                sample.reward, sample.reward_error = self.parse(verdict, self.max_score), None
            except ValueError as exc:
                sample.reward, sample.reward_error = 0.0, f"GenRM: {exc}"
                self._failures["unparseable"] += 1
        return samples

