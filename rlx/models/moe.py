"""Mixture-of-experts routing: record the experts an engine chose, and replay them in the trainer (R3).

transformers 5 gives every MoE family (Mixtral, Qwen2/3-MoE, OLMoE, Qwen3-VL-MoE, the Qwen3-Omni
thinkers) one router interface: a module with `top_k` and a `[experts, hidden]` weight whose
forward takes the flattened hidden states `[N, hidden]` and returns `(logits [N, E], weights
[N, K], experts [N, K])`. `MoeRouting` wraps each router's forward once per model:

- capture: the chosen experts of every forward are collected (the generation engine records them);
- replay: given recorded experts, the router's own choice is replaced by them, and the routing
  weights are gathered from the router's full softmax at the recorded experts (renormalised as the
  family does), so the router still receives gradient through them;
- balance: with `collect_balance`, each training forward keeps every layer's router probabilities
  and the experts it used (replayed ones under R3) for the load-balancing loss.

Routes layout (the `routed_experts` of a generation result, a Sample and the bus): an int16 tensor
`[N, L, K]`: N positions, the tokens the engine ran through the model (prompt tokens and every
generated token but the last, which is sampled and never fed back: len(prompt) + len(response) - 1),
L MoE layers in model order, K experts per token. `NOT_RECORDED` (-1) marks a position without a
record: the trainer routes those tokens itself. int16 holds any expert count in use (DeepSeek-V3 has
256, beyond uint8 once a sentinel is needed) at 2 bytes per entry.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

ROUTE_DTYPE = torch.int16
NOT_RECORDED = -1
_ATTRIBUTE = "_rlx_routing"


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order: modules named `*Router` with `top_k` and a 2-D weight."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("Router") and hasattr(m, "top_k")
            and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2]


class MoeRouting:
    """Capture and replay for one model's routers; `MoeRouting.of(model)` installs it once."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no top-k routers: it is not a mixture-of-experts model "
                             "that rlx can route (families: Mixtral, Qwen2/3-MoE, OLMoE, Qwen3-VL-MoE, Qwen3-Omni)")
        self.top_k = int(self.routers[0].top_k)
        self.num_experts = int(self.routers[0].weight.shape[0])
        self._replay: list[torch.Tensor] | None = None
        self._pending_counts: set[int] = set()  # layers whose mismatch this replay has not counted yet
        self._captured: list[torch.Tensor] | None = None
        self.collect_balance = False  # keep (probabilities, experts) per layer for `balance_loss`
        self._balance: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.differing = 0  # (token, layer) routes where the router's own choice differs from the replayed
        self.compared = 0
        for layer, router in enumerate(self.routers):
            router.forward = functools.partial(self._route, layer, router.forward,
                                               bool(getattr(router, "norm_topk_prob", True)))

    @classmethod
    def of(cls, model: nn.Module) -> MoeRouting:
        routing = getattr(model, _ATTRIBUTE, None)
        if routing is None:
            routing = cls(model)
            object.__setattr__(model, _ATTRIBUTE, routing)  # not a submodule: state_dict stays unchanged
        return routing

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def replay(self, routes: torch.Tensor | None) -> None:
        """Route the next forward passes (and their activation-checkpoint recomputations, which run
        after the forward returns) by `routes` `[B, S, L, K]`, aligned with the input ids; None: the
        routers choose themselves. Stays in force until the next call, which also starts a new
        forward for `balance_loss`."""
        self._replay, self._balance = None, {}
        if routes is None:
            return
        if routes.dim() != 4 or routes.shape[2:] != (self.num_layers, self.top_k):
            raise ValueError(f"routed_experts of shape {tuple(routes.shape)} do not fit this model: expected "
                             f"[batch, positions, {self.num_layers} MoE layers, top-{self.top_k}]")
        flat = routes.reshape(-1, self.num_layers, self.top_k).long()
        self._replay = [flat[:, layer] for layer in range(self.num_layers)]
        self._pending_counts = set(range(self.num_layers))

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Collect the experts each router chose in the forward passes run inside: one `[N, K]`
        tensor per router call, in call order (one forward: one per layer)."""
        self._captured = captured = []
        try:
            yield captured
        finally:
            self._captured = None

    def take_mismatch(self) -> tuple[int, int]:
        """(differing, compared) route counts since the last call, then reset."""
        counts = (self.differing, self.compared)
        self.differing = self.compared = 0
        return counts

    def _route(self, layer: int, forward, renormalise: bool, hidden_states: torch.Tensor):
        logits, weights, experts = forward(hidden_states)
        if self._replay is not None:
            weights, experts = self._replayed(layer, logits, weights, experts, renormalise)
        if self._captured is not None:
            self._captured.append(experts.detach())
        if self.collect_balance and torch.is_grad_enabled():  # a recomputation in backward keeps the first
            self._balance.setdefault(layer, (torch.softmax(logits.float(), dim=-1), experts.detach()))
        return logits, weights, experts

    def balance_loss(self, mask: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss of the last training forward (`load_balancing_loss` over its
        layers), `mask` `[B*S]` marking real tokens."""
        if not self._balance:
            raise RuntimeError("no training forward with collect_balance on since the last replay() call")
        layers = [self._balance[layer] for layer in sorted(self._balance)]
        return load_balancing_loss([p for p, _ in layers], [e for _, e in layers], mask)

    def _replayed(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, own: torch.Tensor,
                  renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        recorded = self._replay[layer].to(own.device)
        if recorded.shape[0] != own.shape[0]:
            raise ValueError(f"routed_experts cover {recorded.shape[0]} positions, the forward has {own.shape[0]}: "
                             "the routes must be aligned with the input ids")
        valid = (recorded >= 0).all(-1, keepdim=True)
        chosen = torch.where(valid, recorded, own)
        if layer in self._pending_counts:
            self._pending_counts.discard(layer)
            differs = (own.sort(-1).values != recorded.sort(-1).values).any(-1) & valid.squeeze(-1)
            self.differing += int(differs.sum())
            self.compared += int(valid.sum())
        gathered = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
        if renormalise:
            gathered = gathered / gathered.sum(-1, keepdim=True)
        return gathered.to(weights.dtype), chosen


def load_balancing_loss(probabilities: list[torch.Tensor], experts: list[torch.Tensor],
                        mask: torch.Tensor) -> torch.Tensor:
    """Switch load balancing per layer, averaged over layers (as Megatron; transformers' Mixtral
    averages f and P over the layers first, the same for one layer): `E * sum_e f_e * P_e`, with `f_e` the
    share of the masked tokens' top-k slots that went to expert e (summing to k) and `P_e` their
    mean router probability of e. `probabilities` `[N, E]` and `experts` `[N, K]` per layer (the
    experts the forward used: the replayed ones under R3); `mask` `[N]`, 1 on real tokens."""
    mask = mask.to(probabilities[0].device, torch.float32)
    tokens = mask.sum().clamp(min=1.0)
    losses = []
    for probs, chosen in zip(probabilities, experts):
        counts = torch.zeros_like(probs).scatter_add_(1, chosen.long(), torch.ones_like(chosen, dtype=probs.dtype))
        share = (counts * mask[:, None]).sum(0) / tokens
        mean_probability = (probs * mask[:, None]).sum(0) / tokens
        losses.append(probs.shape[1] * (share * mean_probability).sum())
    return torch.stack(losses).mean()


def routing_of(model: nn.Module) -> MoeRouting | None:
    """The routing installed on `model` by `MoeRouting.of`, if any."""
    return getattr(model, _ATTRIBUTE, None)


def stack_captured(captured: list[torch.Tensor], batch: int, positions: int) -> torch.Tensor:
    """One forward's captured experts (one `[batch*positions, K]` tensor per layer) as routes
    `[batch, positions, L, K]` in the compact dtype."""
    return torch.stack(captured, dim=1).reshape(batch, positions, len(captured), -1).to(ROUTE_DTYPE).cpu()
