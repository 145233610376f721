"""Greedy evaluation on the held-out split."""

from __future__ import annotations

import time
from collections.abc import Callable

from rlx.data.rows import PromptRow
from rlx.engines.generation.base import SamplingParams
from rlx.orchestration.reports import agent_metrics
from rlx.roles import Reward, Rollout


def evaluate(rollout: Rollout, reward: Reward, rows: list[PromptRow], encode: Callable[[PromptRow], list[int]],
             params: SamplingParams) -> dict[str, float]:
    """Accuracy (share of greedy responses scoring full marks) and mean score on the held-out split.

    Some scorers give partial credit (reasoning-gym's numeric scorer gives len(label)/len(answer)
    when the label is a substring of a wrong answer), so accuracy counts only full marks."""
    if not rows:
        return {}
    start = time.perf_counter()
    groups = [(-1 - i, row, encode(row)) for i, row in enumerate(rows)]
    samples = reward.score(list(rollout.generate(groups, 1, params)))
    # per row: an agent app's episode of several samples (one reward) counts once, in shares
    shares = [1 / s.episode_rows for s in samples]
    return {
        "eval_accuracy": sum(w for w, s in zip(shares, samples) if s.reward >= 1.0) / len(rows),
        "eval_reward_mean": sum(w * s.reward for w, s in zip(shares, samples)) / len(rows),
        "eval_reward_failed": float(round(sum(w for w, s in zip(shares, samples) if s.reward_error is not None), 6)),
        "eval_response_length": sum(len(s.response_ids) for s in samples) / len(samples),
        "time_eval_s": time.perf_counter() - start,
        **{f"eval_{name}": value for name, value in agent_metrics(samples).items()},
    }
