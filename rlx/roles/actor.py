"""Actor: turns scored, advantaged samples into optimizer steps of the policy.

A step may arrive all at once (`train`) or as a stream of micro-batches (`begin_step`,
`accumulate` per micro-batch, `finish_step`). Losses are summed per micro-batch and scaled once
the step's token and sequence counts are known, so both paths give the same update.

With `train.ppo_epochs` > 1 or `train.mini_batches` > 1 a step takes several optimizer updates:
`accumulate` keeps the samples, and `finish_step` takes their old log-probs (ActorFwd's when they
carry them, else one no-grad forward over the step in uid order, before the first update), then
runs the epochs, one update per mini-batch. Nothing depends on the order the samples arrived in.
The weight version still advances once per step; `optimizer_updates` counts the updates.

Mixture-of-experts policies with R3 train on batches that carry the rollout's routes (the model
replays them). Each step reports `route_mismatch_fraction` (the share of (position, layer) routes
where the trainer's router would have chosen other experts) and `rollout_logprob_abs_diff`; every
`algorithm.routing_mismatch_every` steps one extra forward without replay adds
`rollout_logprob_abs_diff_unreplayed`, the mismatch replay removes. `algorithm.router_aux_loss_coef`
adds the load-balancing loss of the experts each forward used (`router_aux_loss`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import torch

from rlx.algorithms.losses import BUS_INPUTS, LossInputs
from rlx.algorithms.objective import finalize_metrics, loss_scale, policy_objective
from rlx.config import AlgorithmConfig
from rlx.data.sample import Sample
from rlx.engines.training.batch import TokenBatch, mini_batch_rows
from rlx.engines.training.engine import TrainingEngine
from rlx.models.moe import routing_of
from rlx.roles.batching import samples_to_batch
from rlx.roles.trainable import Trainable


class Actor(Trainable):
    def __init__(self, engine: TrainingEngine, config: AlgorithmConfig, pad_token_id: int,
                 inputs: Collection[str]) -> None:
        """`inputs` are the bus fields the train task reads (`plan.inputs("train")`): those of
        `BUS_INPUTS` among them become the loss's optional inputs, so which exist follows the plan."""
        self.engine = engine
        self._loss_fields = tuple(name for name in BUS_INPUTS if name in inputs)
        self.config = config
        self.pad_token_id = pad_token_id
        self._sums: dict[str, float] = {}
        self._tokens = self._sequences = 0.0
        self._collected: list[Sample] = []  # the step's samples, when it takes several updates
        self._routing = routing_of(engine.model)
        if config.router_aux_loss_coef > 0:
            if self._routing is None:
                raise ValueError("algorithm.router_aux_loss_coef needs a mixture-of-experts policy with its routing "
                                 "installed (rlx.models.moe.MoeRouting.of(model))")
            self._routing.collect_balance = True

    @property
    def _epochs(self) -> bool:
        """Several updates per step: the streamed single update does not apply."""
        return self.engine.config.ppo_epochs > 1 or self.engine.config.mini_batches > 1

    def begin_step(self) -> None:
        self.engine.begin_step()
        self._sums, self._tokens, self._sequences = {}, 0.0, 0.0
        self._collected = []

    def accumulate(self, samples: list[Sample], counted: bool = True) -> None:
        """Forward and backward one micro-batch (or, with PPO epochs, keep it for `finish_step`).

        Samples carry the loss inputs the train task reads (`ref_logprobs` when the run has a
        reference, `old_logprobs` when it has an ActorFwd: the proximal policy); without the latter
        the "old" log-probs are the current ones, detached,
        which is exact for one optimizer step per batch of fresh samples. `counted=False` is a
        rank's stand-in pass (see `TrainingEngine.accumulate`): same passes, nothing counted.
        """
        if self._epochs:
            self._collected.extend(samples)
            return
        batch = self._batch(samples)
        unreplayed = self._measure_unreplayed(batch)
        metrics = self.engine.accumulate(batch, self._loss_fn, counted)
        if counted:
            self._add({**metrics, **unreplayed})
            self._tokens += float(batch.response_mask.sum())
            self._sequences += float(batch.size)

    def finish_step(self) -> dict[str, float]:
        passes = 1
        if self._epochs:
            self._train_epochs()
            update = self.engine.finish_step()
            passes = self.engine.config.ppo_epochs
        else:
            self._sum_over_ranks()
            update = self.engine.finish_step(grad_scale=loss_scale(self.config.aggregation, self._tokens,
                                                                   self._sequences))
        # every epoch sees each token once: the metrics are means over all of them
        metrics = finalize_metrics(self._sums, self.config.aggregation, self._tokens * passes,
                                   self._sequences * passes)
        metrics.update(update, train_tokens=self._tokens, train_sequences=self._sequences)
        if self._routing is not None:
            counts = self.engine.sum_over_ranks(dict(zip(("differing", "compared"), self._routing.take_mismatch())))
            if counts["compared"]:
                metrics["route_mismatch_fraction"] = counts["differing"] / counts["compared"]
        return metrics

    def _sum_over_ranks(self) -> None:
        """The step's metric sums and token and sequence counts, over every rank of a rank group."""
        sums = self.engine.sum_over_ranks({**self._sums, "__tokens": self._tokens, "__sequences": self._sequences})
        self._tokens, self._sequences = sums.pop("__tokens"), sums.pop("__sequences")
        self._sums = sums

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """One step over samples that are all here, split into micro-batches."""
        self.begin_step()
        size = self.engine.config.micro_batch_size
        for start in range(0, len(samples), size):
            self.accumulate(samples[start : start + size])
        return self.finish_step()

    def _batch(self, samples: list[Sample], own_old_logprobs: bool = False) -> TokenBatch:
        """The samples as one batch with the per-token loss inputs the plan gives the train task
        (`own_old_logprobs`: and the old log-probs `_with_old_logprobs` took). The rollout's
        log-probs are left out when its engine did not record them; any other missing one is an error."""
        per_token = {"advantages": [s.token_advantages or [s.advantage] * len(s.response_ids) for s in samples]}
        names = dict.fromkeys((*self._loss_fields, "old_logprobs") if own_old_logprobs else self._loss_fields)
        for name in names:
            column = [getattr(s, name) for s in samples]
            if all(v is not None and len(v) == len(s.response_ids) for v, s in zip(column, samples)):
                per_token[name] = column
            elif name != "rollout_logprobs":
                lacking = [s.uid for v, s in zip(column, samples) if v is None or len(v) != len(s.response_ids)]
                raise ValueError(f"the train task reads {name!r} (the role plan says so), and samples {lacking[:5]} "
                                 "lack it or have one entry per response token too few or too many")
        return samples_to_batch(samples, self.pad_token_id, per_token)

    def _loss_fn(self, mb: TokenBatch, logprobs: torch.Tensor,
                 entropy: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        tensors = {k: v.to(logprobs.device) for k, v in mb.per_token.items()}
        tensors.setdefault("old_logprobs", logprobs.detach())
        inputs = LossInputs(logprobs, mask=mb.response_mask.to(logprobs.device), **tensors)
        loss, metrics = policy_objective(inputs, entropy, self.config, 1.0, 1.0)
        if self.config.router_aux_loss_coef > 0:
            # summed like the policy loss: weighted by the micro-batch's share of what the step divides by
            weight = float(mb.response_mask.sum()) if self.config.aggregation == "token-mean" else float(mb.size)
            aux = self._routing.balance_loss(mb.attention_mask.reshape(-1)) * weight
            loss = loss + self.config.router_aux_loss_coef * aux
            metrics["router_aux_loss"] = aux.item()
        return loss, metrics

    def _measure_unreplayed(self, batch: TokenBatch) -> dict[str, float]:
        """On the steps `routing_mismatch_every` picks, the summed rollout/trainer log-prob gap of
        `batch` without routing replay: one extra no-grad forward, done before the replayed one."""
        every = self.config.routing_mismatch_every
        if (batch.routes is None or not every or self.engine.step % every
                or "rollout_logprobs" not in batch.per_token):
            return {}
        logprobs = self.engine.outputs(dataclasses.replace(batch, routes=None))
        gap = (logprobs - batch.per_token["rollout_logprobs"]).abs() * batch.response_mask
        return {"rollout_logprob_abs_diff_unreplayed": float(gap.sum())}

    def _add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._sums[key] = self._sums.get(key, 0.0) + value

    def _with_old_logprobs(self, samples: list[Sample]) -> list[Sample]:
        """Copies of `samples`, each with old log-probs: ActorFwd's when it carries them, else those
        of one no-grad forward, taken before the step's first update."""
        missing = [s for s in samples if s.old_logprobs is None]
        if not missing:
            return list(samples)
        rows = iter(self.engine.outputs(samples_to_batch(missing, self.pad_token_id)))
        return [s if s.old_logprobs is not None
                else dataclasses.replace(s, old_logprobs=next(rows)[: len(s.response_ids)].tolist())
                for s in samples]

    def _train_epochs(self) -> None:
        """`ppo_epochs` passes over the collected step, in uid order; each mini-batch (fixed by uid)
        is micro-batched and is one optimizer update, its loss scaled by its own token (or sequence)
        count, so micro-batching never changes it."""
        if not self._collected:
            return
        cfg = self.engine.config
        samples = self._with_old_logprobs(sorted(self._collected, key=lambda s: s.uid))
        batch = self._batch(samples, own_old_logprobs=True)
        self._add(self._measure_unreplayed(batch))
        self._tokens, self._sequences = float(batch.response_mask.sum()), float(batch.size)
        minis = [batch.select(torch.tensor(rows))
                 for rows in mini_batch_rows([s.uid for s in samples], cfg.mini_batches, cfg.seed) if rows]
        for _ in range(cfg.ppo_epochs):
            for mini in minis:
                for micro_batch in mini.micro_batches(cfg.micro_batch_size):
                    self._add(self.engine.accumulate(micro_batch, self._loss_fn))
                self.engine.update(loss_scale(self.config.aggregation, float(mini.response_mask.sum()),
                                              float(mini.size)))
