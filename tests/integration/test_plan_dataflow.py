"""The role plan carries every field a rollout makes to the loss, and the two modes' workers give
the same update on the same samples."""

from __future__ import annotations

import torch

from rlx.bus import LocalBus
from rlx.orchestration.builder import build_components, build_workers
from rlx.orchestration.plan import FIELDS
from tests.integration.test_colocate_loop import toy_config


def one_step(config, *, threaded: bool, mask_after_first: bool = False):
    """Generate, score and train one step on a LocalBus. `threaded`: the scoring workers run on
    their own threads and the trainer streams micro-batches as they are ready (async mode's
    workers); otherwise each phase drains in plan order (colocated mode)."""
    torch.manual_seed(0)
    c = build_components(config)
    bus = LocalBus(check_schema=FIELDS)
    with build_workers(c, bus, sync_weights=lambda: None, publish=lambda: None, max_staleness=0) as workers:
        if mask_after_first:  # a rollout that trains only the first token of each response
            generate = c.rollout.generate

            def masked(*args, **kwargs):
                for sample in generate(*args, **kwargs):
                    sample.loss_mask = [1.0] + [0.0] * (len(sample.response_ids) - 1)
                    yield sample

            c.rollout.generate = masked
        rows = workers.rollout.generate(config.rollout.prompts_per_step)
        scorers = [workers.by_task[task] for task in c.plan.phase_order if task != "train"]
        if threaded:
            for worker in scorers:
                worker.run_forever()
            metrics = workers.actor.train_step()
        else:
            for worker in scorers:
                worker.drain()
            metrics = workers.actor.train_step(rows)
    return metrics, {name: p.detach().clone() for name, p in c.actor.engine.model.named_parameters()}


def test_a_loss_mask_made_by_the_rollout_reaches_the_loss(tiny_path, tmp_path):
    config = toy_config(tiny_path, tmp_path, algorithm__filter_zero_std_groups=False, train__micro_batch_size=8)
    full, _ = one_step(config, threaded=False)
    masked, _ = one_step(config, threaded=False, mask_after_first=True)
    assert full["train_tokens"] > full["trained_samples"]
    assert masked["train_tokens"] == masked["trained_samples"] == 32  # one trained token per response


def test_async_workers_and_colocated_phases_give_the_same_update(tiny_path, tmp_path):
    colocated = toy_config(tiny_path, tmp_path, algorithm__kl_coef=0.1, train__micro_batch_size=16)
    streamed = toy_config(tiny_path, tmp_path, algorithm__kl_coef=0.1, train__micro_batch_size=4)
    metrics_a, params_a = one_step(colocated, threaded=False)
    metrics_b, params_b = one_step(streamed, threaded=True)
    assert metrics_a["trained_samples"] == metrics_b["trained_samples"] > 0
    assert metrics_a["train_tokens"] == metrics_b["train_tokens"]
    # micro-batches of 16 vs 4 in arrival order sum gradients in another order: float noise of ~1e-6,
    # while one Adam update at lr 3e-3 moves a weight by up to 3e-3
    for name, value in params_a.items():
        torch.testing.assert_close(params_b[name], value, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert abs(metrics_a["loss"] - metrics_b["loss"]) < 1e-5
