"""Routing capture and replay (R3) on tiny Qwen3-MoE, Mixtral and OLMoE models built in code."""

from __future__ import annotations

import pytest
import torch

from rlx.engines.training.batch import collate
from rlx.model_kinds import is_moe_config, is_moe_model
from rlx.models.moe import (
    NOT_RECORDED,
    ROUTE_DTYPE,
    MoeRouting,
    load_balancing_loss,
    routing_of,
    stack_captured,
)
from rlx.models.tiny import MOE_FAMILIES, build_tiny, tiny_model, tiny_moe_model

VOCAB = 50


def _ids(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _captured(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    routing = MoeRouting.of(model)
    with routing.capture() as captured:
        logits = model(input_ids=ids).logits
    return logits, stack_captured(captured, *ids.shape)


def _random_routes(routing: MoeRouting, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    picks = [torch.randperm(routing.num_experts, generator=generator)[: routing.top_k]
             for _ in range(batch * length * routing.num_layers)]
    return torch.stack(picks).reshape(batch, length, routing.num_layers, routing.top_k).to(ROUTE_DTYPE)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_the_routers_own_choice_changes_nothing(family):
    """The replay path recomputes the routing weights from the full softmax: with the router's own
    experts they must be bitwise the family's own weights (this pins each family's renormalisation)."""
    model = tiny_moe_model(family, VOCAB)
    ids = _ids()
    logits, routes = _captured(model, ids)
    assert routes.dtype == ROUTE_DTYPE and routes.shape == (2, 9, 2, 2)
    routing = MoeRouting.of(model)
    routing.replay(routes)
    assert torch.equal(model(input_ids=ids).logits, logits)
    assert routing.take_mismatch() == (0, 2 * 9 * 2)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_replayed_forward_selects_exactly_the_recorded_experts_and_the_router_learns(family):
    model = tiny_moe_model(family, VOCAB)
    routing = MoeRouting.of(model)
    ids = _ids()
    free_logits, _ = _captured(model, ids)
    recorded = _random_routes(routing, *ids.shape)
    routing.replay(recorded)
    with routing.capture() as captured:
        logits = model(input_ids=ids).logits
    assert torch.equal(stack_captured(captured, *ids.shape), recorded)
    assert not torch.allclose(logits, free_logits)  # other experts, other outputs
    differing, compared = routing.take_mismatch()
    assert compared == recorded[..., 0].numel() and differing > compared // 2  # random routes mostly differ
    logits.square().mean().backward()
    for router in routing.routers:  # the gathered routing weights keep the router in the graph
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_unrecorded_positions_are_routed_by_the_model():
    model = tiny_moe_model("qwen3_moe", VOCAB)
    routing = MoeRouting.of(model)
    ids = _ids(batch=1)
    _free_logits, own = _captured(model, ids)
    recorded = _random_routes(routing, *ids.shape)
    recorded[:, 5:] = NOT_RECORDED
    routing.replay(recorded)
    with routing.capture() as captured:
        model(input_ids=ids)
    used = stack_captured(captured, *ids.shape)
    assert torch.equal(used[:, :5], recorded[:, :5])
    assert torch.equal(used[:, 5:].sort(-1).values, own[:, 5:].sort(-1).values)
    assert routing.take_mismatch()[1] == 5 * routing.num_layers


def test_replay_holds_through_activation_checkpoint_recomputation():
    """Recomputation runs in backward, after the forward returned: the routes must still apply,
    or the recomputed activations (and gradients) would belong to other experts."""
    ids = _ids()
    grads = []
    for checkpointing in (False, True):
        model = tiny_moe_model("mixtral", VOCAB)
        routing = MoeRouting.of(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        routing.replay(_random_routes(routing, *ids.shape))
        model(input_ids=ids).logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        assert routing.take_mismatch()[1] == ids.numel() * routing.num_layers  # counted once, not per recompute
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_routes_of_the_wrong_shape_are_refused_with_the_expected_shape():
    model = tiny_moe_model("olmoe", VOCAB)
    routing = MoeRouting.of(model)
    with pytest.raises(ValueError, match=r"expected \[batch, positions, 2 MoE layers, top-2\]"):
        routing.replay(torch.zeros((1, 4, 3, 2), dtype=ROUTE_DTYPE))
    routing.replay(torch.zeros((1, 4, 2, 2), dtype=ROUTE_DTYPE))
    with pytest.raises(ValueError, match="aligned with the input ids"):
        model(input_ids=_ids(batch=1, length=6))


def test_a_dense_model_has_no_routing():
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        MoeRouting.of(tiny_model(VOCAB))
    assert routing_of(tiny_model(VOCAB)) is None


def test_routes_are_collated_under_their_tokens_and_follow_micro_batches():
    prompts, responses = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13]]
    routes = [torch.arange(4 * 2 * 1, dtype=ROUTE_DTYPE).reshape(4, 2, 1),  # 3 + 2 - 1 positions
              torch.full((3, 2, 1), 7, dtype=ROUTE_DTYPE)]  # 1 + 3 - 1
    batch = collate(prompts, responses, pad_token_id=0, routes=routes)
    assert batch.routes.shape == (2, 6, 2, 1)  # prompt width 3 + response width 3
    assert torch.equal(batch.routes[0, :4], routes[0]) and (batch.routes[0, 4:] == NOT_RECORDED).all()
    assert (batch.routes[1, :2] == NOT_RECORDED).all() and torch.equal(batch.routes[1, 2:5], routes[1])
    second = batch.micro_batches(1)[1]  # trimmed of the padding columns, routes with them
    assert second.routes.shape[1] == second.input_ids.shape[1] == 4
    assert torch.equal(second.routes[0, :3], routes[1])


def test_moe_models_are_told_from_their_config_without_loading(tmp_path):
    assert is_moe_config({"num_local_experts": 8, "num_experts_per_tok": 2})
    assert is_moe_config({"text_config": {"num_experts": 64, "num_experts_per_tok": 8}})
    assert not is_moe_config({"hidden_size": 64})
    assert is_moe_model("tiny-moe") and not is_moe_model("smollm2-135m-instruct")
    assert is_moe_model(str(build_tiny(tmp_path / "moe", moe_family="mixtral"))) is True
    assert is_moe_model(str(build_tiny(tmp_path / "dense"))) is False
    assert is_moe_model(str(tmp_path / "missing")) is None


def test_load_balancing_loss_by_hand():
    balanced = load_balancing_loss([torch.tensor([[0.75, 0.25], [0.25, 0.75]])], [torch.tensor([[0], [1]])],
                                   torch.ones(2))
    skewed = load_balancing_loss([torch.tensor([[0.75, 0.25], [0.75, 0.25]])], [torch.tensor([[0], [0]])],
                                 torch.ones(2))
    assert balanced.item() == pytest.approx(2 * (0.5 * 0.5 + 0.5 * 0.5))  # E * sum f_e P_e = 1: the minimum
    assert skewed.item() == pytest.approx(2 * (1.0 * 0.75))
    masked = load_balancing_loss([torch.tensor([[0.75, 0.25], [0.1, 0.9]])], [torch.tensor([[0], [1]])],
                                 torch.tensor([1.0, 0.0]))  # the padding token counts for nothing
    assert masked.item() == pytest.approx(2 * (1.0 * 0.75))


def test_balance_loss_matches_transformers_and_uses_the_replayed_experts():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = tiny_moe_model("mixtral", VOCAB, layers=1)  # transformers averages f and P over layers first
    routing = MoeRouting.of(model)
    routing.collect_balance = True
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    routing.replay(None)
    output = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    ours = routing.balance_loss(mask.reshape(-1))
    theirs = load_balancing_loss_func(output.router_logits, routing.num_experts, routing.top_k, mask)
    torch.testing.assert_close(ours, theirs.float())
    all_to_one = torch.zeros((*ids.shape, routing.num_layers, routing.top_k), dtype=ROUTE_DTYPE)
    all_to_one[..., 1] = 1  # every token to experts {0, 1}: as unbalanced as top-2 of 8 gets
    routing.replay(all_to_one)
    (logits,) = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
    replayed = routing.balance_loss(mask.reshape(-1))
    real = mask.reshape(-1).bool()
    mean_probability = torch.softmax(logits.float(), -1)[real].mean(0)
    # f = 1 for experts 0 and 1 (every token uses both), 0 for the rest: E * (P_0 + P_1)
    torch.testing.assert_close(replayed, routing.num_experts * mean_probability[:2].sum())
    replayed.backward()
    assert all(router.weight.grad.abs().sum() > 0 for router in routing.routers)
