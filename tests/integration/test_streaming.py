"""Streaming on the bus: a slow reward does not stall the trainer while other micro-batches are ready."""

from __future__ import annotations

import json
import time

from rlx.bus import LocalBus
from rlx.config import build_config
from rlx.orchestration.builder import build_components, build_workers
from rlx.orchestration.plan import FIELDS


def test_slow_reward_does_not_stall_training(tiny_path, tmp_path):
    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"p{i}", "label": "a", "metadata": {"slow": i == 0}} for i in range(4)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = build_config({
        "model": {"path": str(tiny_path)},
        "data": {"source": "jsonl", "path": str(data)},
        "rollout": {"n": 2, "prompts_per_step": 4, "max_new_tokens": 6},
        "reward": {"name": "tests.integration.slow_reward:slow_for_group_zero"},
        "algorithm": {"filter_zero_std_groups": False},
        "train": {"micro_batch_size": 2, "lr": 1e-3},
    })
    c = build_components(config)
    bus = LocalBus(check_schema=FIELDS)
    workers = build_workers(c, bus, sync_weights=lambda: None,
                            publish=c.sync_weights, max_staleness=0)
    accumulated_at: list[float] = []
    original = c.actor.accumulate

    def timed_accumulate(samples):
        accumulated_at.append(time.monotonic())
        return original(samples)

    c.actor.accumulate = timed_accumulate
    finished: list[float] = []  # when the slow sample's score came back (the pool's process cannot write a file)
    score = c.reward.score

    def timed_score(samples):
        scored = score(samples)
        if any(s.metadata.get("slow") for s in samples):
            finished.append(time.monotonic())
        return scored

    c.reward.score = timed_score
    for worker in (workers.reward, workers.advantages):
        worker.run_forever()
    try:
        workers.rollout.generate(4)  # all four prompts, one of them with the slow reward
        metrics = workers.actor.train_step()
    finally:
        workers.stop()
    assert metrics["trained_samples"] == 8
    assert len(accumulated_at) == 4
    early = [t for t in accumulated_at if t < finished[0]]
    assert len(early) == 3, "the three fast groups must train while the slow reward is still running"
