"""Greedy evaluation on the held-out split."""

from __future__ import annotations

import time

from rlx.orchestration.builder import Components


def evaluate(c: Components) -> dict[str, float]:
    if not c.eval_rows:
        return {}
    start = time.perf_counter()
    groups = [(-1 - i, row, c.encode(row)) for i, row in enumerate(c.eval_rows)]
    samples = c.reward.score(list(c.rollout.generate(groups, 1, c.sampling(seed=0, greedy=True))))
    scores = [s.reward for s in samples]
    return {
        "eval_accuracy": sum(scores) / len(scores),
        "eval_reward_failed": float(sum(s.reward_error is not None for s in samples)),
        "eval_response_length": sum(len(s.response_ids) for s in samples) / len(samples),
        "time_eval_s": time.perf_counter() - start,
    }
