"""GenRM: a judge LLM on its own generation engine scores responses from a prompt template.

The judge's generation has a deadline (`reward.judge.timeout_s`): past it the batch stops and its
unjudged samples fail (timeout). Each verdict is parsed like a reward is scored (`outcome_of`): a
custom parser runs in a reward pool process within `reward.timeout_s`, and a parser that raises
anything, hangs or returns a value that is not a finite number in [0, 1] fails only its sample.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from rlx.data.sample import Sample
from rlx.engines.generation.base import GenerationEngine, GenerationRequest, SamplingParams
from rlx.rewards import PooledReward, RewardOutcome, RewardPool, outcome_of
from rlx.rewards.judge import JudgeParser
from rlx.rewards.safe import rollout_failure

if TYPE_CHECKING:  # transformers costs seconds to import; services without a model skip it
    from transformers import PreTrainedTokenizerBase


class _Late(Exception):
    """The judge's batch ran past its deadline."""


class GenRM:
    def __init__(self, engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase, template: str,
                 parse: JudgeParser, max_score: float, params: SamplingParams, timeout_s: float = 300.0,
                 parse_timeout_s: float | None = 60.0) -> None:
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        self.parse, self.max_score, self.params = parse, max_score, params
        self.timeout_s, self.parse_timeout_s = timeout_s, parse_timeout_s
        self._ids = itertools.count()
        self._failures: Counter[str] = Counter()
        self._pool: RewardPool | None = None
        self._lock = threading.Lock()

    @property
    def failures(self) -> dict[str, int]:
        """Failed samples so far, by class (as the Reward role reports them): an unparseable verdict
        is `error`, a bad parsed value `bad_value`, a judge or parser past its deadline `timeout`."""
        return dict(self._failures)

    def close(self) -> None:
        """Stop the custom parser's pool processes (the judge's engine lives as long as its process)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _parser_pool(self) -> RewardPool | None:
        if not isinstance(self.parse, PooledReward):
            return None
        with self._lock:
            if self._pool is None:
                self._pool = self.parse.new_pool(1)
            return self._pool

    def judge_prompt(self, sample: Sample) -> list[int]:
        text = self.template.format(question=sample.prompt_text, response=sample.response_text, label=sample.label)
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                      add_generation_prompt=True, return_dict=False)
        return self.tokenizer(text)["input_ids"]

    def verdicts(self, samples: list[Sample]) -> dict[int, str]:
        """The judge's text per sample index, for those it finished within `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s

        def on_time() -> None:
            if time.monotonic() > deadline:
                raise _Late

        batch = [GenerationRequest(request_id=next(self._ids), prompt_ids=self.judge_prompt(s)) for s in samples]
        index = {request.request_id: i for i, request in enumerate(batch)}
        texts: dict[int, str] = {}
        try:
            for result in self.engine.stream(batch, self.params, between_steps=on_time):
                texts[index[result.request_id]] = self.tokenizer.decode(result.response_ids, skip_special_tokens=True)
        except _Late:  # the engine aborts the rest as the stream closes
            pass
        return texts

    def _outcome(self, verdict: str | None) -> RewardOutcome:
        if verdict is None:
            return RewardOutcome(0.0, f"GenRM: the judge gave no verdict within reward.judge.timeout_s={self.timeout_s}s",
                                 "timeout")
        outcome = outcome_of(self.parse, (verdict, self.max_score), self.parse_timeout_s, self._parser_pool())
        if outcome.failed:
            return RewardOutcome(0.0, f"GenRM: {outcome.error}", outcome.kind)
        if not 0.0 <= outcome.score <= 1.0:
            return RewardOutcome(0.0, f"GenRM: the parser returned {outcome.score}; a judge score is in [0, 1]",
                                 "bad_value")
        return outcome

    def score(self, samples: list[Sample]) -> list[Sample]:
        """One batched generation for the samples whose rollout did not fail; a verdict that is late,
        unparseable or out of range fails only its sample."""
        outcomes = [rollout_failure(s.metadata) for s in samples]
        judged = [i for i, outcome in enumerate(outcomes) if outcome is None]
        texts = self.verdicts([samples[i] for i in judged])
        for position, i in enumerate(judged):
            outcomes[i] = self._outcome(texts.get(position))
        with self._lock:
            self._failures.update(o.kind or "error" for o in outcomes if o is not None and o.failed)
        for sample, outcome in zip(samples, outcomes):
            assert outcome is not None
            sample.reward, sample.reward_error = outcome.score, outcome.error
        return samples
