"""Actor: turns scored, advantaged samples into optimizer steps of the policy.

A step may arrive all at once (`train`) or as a stream of micro-batches (`begin_step`,
`accumulate` per micro-batch, `finish_step`). Losses are summed per micro-batch and scaled once
the step's token and sequence counts are known, so both paths give the same update.
"""

from __future__ import annotations

import torch

from rlx.algorithms.objective import finalize_metrics, loss_scale, policy_objective
from rlx.config import AlgorithmConfig
from rlx.data.sample import Sample
from rlx.engines.training.engine import TrainingEngine
from rlx.roles.batching import samples_to_batch


class Actor:
    def __init__(self, engine: TrainingEngine, config: AlgorithmConfig, pad_token_id: int) -> None:
        self.engine = engine
        self.config = config
        self.pad_token_id = pad_token_id
        self._sums: dict[str, float] = {}
        self._tokens = self._sequences = 0.0

    @property
    def version(self) -> int:
        """Published weight version = optimizer steps taken."""
        return self.engine.step

    def begin_step(self) -> None:
        self.engine.begin_step()
        self._sums, self._tokens, self._sequences = {}, 0.0, 0.0

    def accumulate(self, samples: list[Sample]) -> None:
        """Forward and backward one micro-batch.

        Samples carry `ref_logprobs` when KL is on and may carry `old_logprobs` (the proximal
        policy, from ActorFwd); without them the "old" log-probs are the current ones, detached,
        which is exact for one optimizer step per batch of fresh samples.
        """
        per_token = {"advantages": [s.token_advantages or [s.advantage] * len(s.response_ids) for s in samples]}
        if self.config.behavior_correction != "none":
            per_token["rollout_logprobs"] = [s.rollout_logprobs for s in samples]
        if self.config.kl_coef > 0:
            per_token["ref_logprobs"] = [s.ref_logprobs for s in samples]
        if all(s.old_logprobs is not None for s in samples):
            per_token["old_logprobs"] = [s.old_logprobs for s in samples]
        batch = samples_to_batch(samples, self.pad_token_id, per_token)

        def loss_fn(mb, logprobs, entropy):
            fields = {k: v.to(logprobs.device) for k, v in mb.per_token.items()}
            fields.setdefault("old_logprobs", logprobs.detach())
            return policy_objective(logprobs, entropy, mb.response_mask.to(logprobs.device), fields, self.config,
                                    1.0, 1.0)

        metrics = self.engine.accumulate(batch, loss_fn)
        for key, value in metrics.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
        self._tokens += float(batch.response_mask.sum())
        self._sequences += float(batch.size)

    def finish_step(self) -> dict[str, float]:
        scale = loss_scale(self.config.aggregation, self._tokens, self._sequences)
        metrics = finalize_metrics(self._sums, self.config.aggregation, self._tokens, self._sequences)
        metrics.update(self.engine.finish_step(grad_scale=scale))
        metrics.update(train_tokens=self._tokens, train_sequences=self._sequences)
        return metrics

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """One step over samples that are all here, split into micro-batches."""
        self.begin_step()
        size = self.engine.config.micro_batch_size
        for start in range(0, len(samples), size):
            self.accumulate(samples[start : start + size])
        return self.finish_step()

    def weights(self) -> dict[str, torch.Tensor]:
        return self.engine.weights()
