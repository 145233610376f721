"""Actor: turns scored, advantaged samples into one optimizer step of the policy."""

from __future__ import annotations

import torch

from rlx.algorithms.objective import policy_objective
from rlx.config import AlgorithmConfig
from rlx.data.sample import Sample
from rlx.engines.training.engine import TrainingEngine
from rlx.roles.batching import samples_to_batch


class Actor:
    def __init__(self, engine: TrainingEngine, config: AlgorithmConfig, pad_token_id: int) -> None:
        self.engine = engine
        self.config = config
        self.pad_token_id = pad_token_id

    @property
    def version(self) -> int:
        """Published weight version = optimizer steps taken."""
        return self.engine.step

    def train(self, samples: list[Sample], ref_logprobs: list[list[float]] | None = None) -> dict[str, float]:
        per_token = {"advantages": [[s.advantage] * len(s.response_ids) for s in samples]}
        if ref_logprobs is not None:
            per_token["ref_logprobs"] = ref_logprobs
        batch = samples_to_batch(samples, self.pad_token_id, per_token)
        # One optimizer step per batch: the policy that sampled is the policy being updated, so the
        # "old" log-probs are the current ones, detached (ratio 1, gradient of the surrogate intact).
        global_tokens = float(batch.response_mask.sum())

        def loss_fn(mb, logprobs, entropy):
            fields = {k: v.to(logprobs.device) for k, v in mb.per_token.items()}
            fields["old_logprobs"] = logprobs.detach()
            return policy_objective(logprobs, entropy, mb.response_mask.to(logprobs.device), fields, self.config,
                                    global_tokens, float(batch.size))

        metrics = self.engine.train_step(batch, loss_fn)
        metrics["train_tokens"] = global_tokens
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        return self.engine.weights()
