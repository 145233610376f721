"""Critic: the value model of PPO. Writes the value of every sampled response's states to the bus,
and regresses them onto the GAE returns with a clipped value loss, on its own engine and optimizer."""

from __future__ import annotations

from rlx.algorithms.values import clipped_value_loss
from rlx.data.sample import Sample
from rlx.engines.training.engine import TrainingEngine
from rlx.roles.batching import samples_to_batch
from rlx.roles.trainable import Trainable


class Critic(Trainable):
    def __init__(self, engine: TrainingEngine, pad_token_id: int, value_clip: float) -> None:
        self.engine, self.pad_token_id, self.value_clip = engine, pad_token_id, value_clip
        self._sums: dict[str, float] = {}
        self._tokens = 0.0

    def values(self, samples: list[Sample]) -> list[list[float]]:
        out = self.engine.outputs(samples_to_batch(samples, self.pad_token_id))
        return [row[: len(s.response_ids)].tolist() for s, row in zip(samples, out)]

    def begin_step(self) -> None:
        self.engine.begin_step()
        self._sums, self._tokens = {}, 0.0

    def accumulate(self, samples: list[Sample], counted: bool = True) -> None:
        """Forward and backward one micro-batch of samples carrying `values` (old) and `returns`
        (`counted=False`: a rank's stand-in pass, see `TrainingEngine.accumulate`)."""
        batch = samples_to_batch(samples, self.pad_token_id, {"old_values": [s.values for s in samples],
                                                              "returns": [s.returns for s in samples]})

        def loss_fn(mb, values, _):
            mask = mb.response_mask.to(values.device)
            old, returns = mb.per_token["old_values"].to(values.device), mb.per_token["returns"].to(values.device)
            loss = (clipped_value_loss(values, old, returns, self.value_clip) * mask).sum()
            clipped = ((values - old).abs() > self.value_clip).float()
            return loss, {
                "value_loss": loss.item(),
                "value_clip_fraction": float((clipped * mask).sum()),
                "value_mean": float((values.detach() * mask).sum()),
                "value_error": float(((values.detach() - returns).abs() * mask).sum()),
            }

        metrics = self.engine.accumulate(batch, loss_fn, counted)
        if counted:
            for key, value in metrics.items():
                self._sums[key] = self._sums.get(key, 0.0) + value
            self._tokens += float(batch.response_mask.sum())

    def finish_step(self) -> dict[str, float]:
        """Token-mean of the summed losses and metrics (over every rank), then the optimizer step."""
        sums = self.engine.sum_over_ranks({**self._sums, "__tokens": self._tokens})
        scale = 1.0 / max(sums.pop("__tokens"), 1.0)
        metrics = {k: v * scale for k, v in sums.items()}
        update = self.engine.finish_step(grad_scale=scale)
        metrics.update(critic_lr=update["lr"], critic_grad_norm=update["grad_norm"])
        return metrics
