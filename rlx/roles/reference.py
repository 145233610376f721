"""Forward-only log-prob roles: Reference (for the KL term: frozen, or reset to the policy every few
steps) and ActorFwd (follows the policy)."""

from __future__ import annotations

import torch

from rlx.data.sample import Sample
from rlx.engines.training.forward import token_logprobs
from rlx.engines.training.placement import ONE_PROCESS, Placement
from rlx.obs.timeline import SPANS
from rlx.roles.batching import samples_to_batch


class Reference:
    weight_version = 0
    timeline_role = "reference"  # the role its weight loads are recorded under (`rlx.obs.timeline`)

    def __init__(self, model, pad_token_id: int, temperature: float, micro_batch_size: int,
                 refresh_every: int = 0, bf16: bool = False, share_prompts: bool = False,
                 placement: Placement = ONE_PROCESS) -> None:
        """`refresh_every` > 0: the reference takes the policy's weights once they are that many
        versions newer than its own (a periodically reset KL anchor); 0: it stays frozen. `bf16`:
        forwards under bf16 autocast, as the trainer runs them (ActorFwd: the same numerics).
        `share_prompts`: rows that share a prompt run it once (`rlx.engines.training.forward`).
        `placement`: where the weights live (a rank of a group: `rlx.roles.sharded`)."""
        self.model = model.eval().requires_grad_(False)
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.refresh_every = refresh_every
        self.bf16 = bf16
        self.share_prompts = share_prompts
        self.placement = placement

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad(), SPANS.span("load_weights", self.timeline_role, version=version):
            self.placement.load_weights(self.model, state_dict)
        self.weight_version = version

    def refresh(self, state_dict: dict[str, torch.Tensor], version: int) -> bool:
        """Offer the policy's weights of `version`; taken when a refresh is due, or when the policy
        went back behind the reference (a restored Actor). True if taken."""
        due = self.refresh_every > 0 and (version >= self.weight_version + self.refresh_every
                                          or version < self.weight_version)
        if due:
            self.load_weights(state_dict, version)
        return due

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        size = self.micro_batch_size
        chunks = [samples[start : start + size] for start in range(0, len(samples), size)]
        out = []
        try:  # a rank of a group runs as many passes as the busiest rank: the repeats' outputs are dropped
            for chunk in self.placement.in_lockstep(chunks):
                logprobs, _ = token_logprobs(self.model, samples_to_batch(chunk, self.pad_token_id), self.temperature,
                                             bf16=self.bf16, share_prompts=self.share_prompts)
                out.extend(lp[: len(s.response_ids)].tolist() for s, lp in zip(chunk, logprobs))
        finally:
            self.placement.after_forward(self.model)
        return out[: len(samples)]


class ActorFwd(Reference):
    """Log-probs under the latest published policy: the proximal policy of decoupled PPO.

    Computed on its own resources as samples arrive, so these forward passes overlap training."""

    timeline_role = "actor_fwd"
