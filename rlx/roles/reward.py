"""Reward: scores each sample (or each group); a failing reward function fails only its samples.

A `PooledReward` (every reward but rlx's own string matching: user code, reasoning_gym,
math_verify; see rlx.rewards.build_reward) runs in a process pool the role starts on first use,
keeps warm, and stops on `close()` (the next score starts a new one); other rewards run in this
process. `failures` counts failed samples by class (error, timeout, crash, bad_value, and
bad_media for a group whose media would not decode) for the worker to report.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from rlx.data.sample import Sample
from rlx.rewards import PooledReward, RewardOutcome, RewardPool, score_group_safely, score_safely
from rlx.rewards.shaping import overlong_penalty


class Reward:
    def __init__(self, reward_fn: Callable[..., Any], max_length: int = 0, overlong_buffer: int = 0,
                 overlong_factor: float = 1.0, scope: str = "sample", timeout_s: float | None = None,
                 pool: RewardPool | None = None, pool_size: int = 8) -> None:
        """`pool`: a pool to share (the caller closes it); without one the role starts its own of
        up to `pool_size` processes when a pooled reward is first scored."""
        self.reward_fn, self.scope, self.timeout_s = reward_fn, scope, timeout_s
        self.max_length, self.overlong_buffer, self.overlong_factor = max_length, overlong_buffer, overlong_factor
        self._pool, self._owns_pool, self.pool_size = pool, pool is None, pool_size
        self._lock = threading.Lock()
        self._failures: Counter[str] = Counter()

    @property
    def failures(self) -> dict[str, int]:
        """Failed samples so far, by failure class."""
        with self._lock:
            return dict(self._failures)

    def _current_pool(self) -> RewardPool | None:
        if not isinstance(self.reward_fn, PooledReward):
            return None
        with self._lock:
            if self._pool is None:
                self._pool = self.reward_fn.new_pool(self.pool_size)
            return self._pool

    def close(self) -> None:
        """Stop the role's own pool processes (a shared pool is its owner's to close)."""
        with self._lock:
            pool = self._pool if self._owns_pool else None
            if self._owns_pool:
                self._pool = None
        if pool is not None:
            pool.close()

    def _outcomes(self, samples: list[Sample]) -> list[RewardOutcome]:
        pool = self._current_pool()
        if self.scope == "sample":
            return [score_safely(self.reward_fn, s.response_text, s.label, s.metadata, self.timeout_s, pool)
                    for s in samples]
        groups: dict[int, list[int]] = defaultdict(list)
        for i, sample in enumerate(samples):
            groups[sample.group_id].append(i)
        outcomes: list[RewardOutcome] = [RewardOutcome(0.0)] * len(samples)
        for members in groups.values():
            first = samples[members[0]]
            scored = score_group_safely(self.reward_fn, [samples[i].response_text for i in members], first.label,
                                        first.metadata, self.timeout_s, pool)
            for i, outcome in zip(members, scored):
                outcomes[i] = outcome
        return outcomes

    def score(self, samples: list[Sample]) -> list[Sample]:
        """Set `reward` (or `reward_error`) on every sample; group scope needs whole groups."""
        outcomes = self._outcomes(samples)
        with self._lock:
            self._failures.update(o.kind or "error" for o in outcomes if o.failed)
        for sample, outcome in zip(samples, outcomes):
            sample.reward, sample.reward_error = outcome.score, outcome.error
            if not outcome.failed and self.overlong_buffer:
                sample.reward += overlong_penalty(len(sample.response_ids), self.max_length, self.overlong_buffer,
                                                  self.overlong_factor)
        return samples
