"""What a training step reports: its sample statistics, and the reports a worker holds until the
driver has them (a reply lost to a timeout is handed out again, never lost)."""

from __future__ import annotations

import uuid
from collections import Counter

from rlx.data.sample import Sample

Cursor = tuple[str, int]  # (the worker instance, the index of a report it made)


class StepReports:
    """Metrics of finished steps, held until the driver confirms it has them: a reply lost to a
    timeout (a busy or dying replica) is handed out again by the next call instead of vanishing."""

    def __init__(self) -> None:
        self.origin = uuid.uuid4().hex  # a replacement worker numbers its reports afresh
        self.pending: list[tuple[int, dict[str, float]]] = []
        self.made = 0

    def add(self, metrics: dict[str, float]) -> None:
        self.pending.append((self.made, metrics))
        self.made += 1

    def after(self, cursor: Cursor | None) -> list[tuple[Cursor, dict[str, float]]]:
        """The reports after `cursor`, the last one the caller holds; those up to it are dropped."""
        if cursor is not None and cursor[0] == self.origin:
            self.pending = [(i, m) for i, m in self.pending if i > cursor[1]]
        return [((self.origin, i), dict(m)) for i, m in self.pending]

    def drain(self) -> list[dict[str, float]]:
        """Every pending report, each handed out once (colocated mode: no reply can be lost)."""
        reported, self.pending = [m for _, m in self.pending], []
        return reported


def batch_metrics(samples: list[Sample], trainer_version: int) -> dict[str, float]:
    """Reward, length and staleness statistics of one step's samples."""
    lengths = [len(s.response_ids) for s in samples]
    rewards = [s.reward for s in samples if s.reward_error is None and s.reward is not None]
    staleness = Counter(trainer_version - s.behavior_version for s in samples)
    return {
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        "reward_failed": float(sum(s.reward_error is not None for s in samples)),
        "response_length": sum(lengths) / max(1, len(lengths)),
        "truncated_fraction": sum(s.finish_reason == "length" for s in samples) / max(1, len(samples)),
        "staleness_mean": sum(k * v for k, v in staleness.items()) / max(1, len(samples)),
        # samples whose weights changed mid-generation (a version loaded between decode steps)
        "mixed_version_fraction": sum(s.last_behavior_version not in (None, s.behavior_version)
                                      for s in samples) / max(1, len(samples)),
        **{f"staleness_{k}": float(v) for k, v in sorted(staleness.items())},
        **proximal_metrics(samples, trainer_version),
        **distillation_metrics(samples),
    }


def proximal_metrics(samples: list[Sample], trainer_version: int) -> dict[str, float]:
    """How far behind the trainer the proximal policy of decoupled PPO was (ActorFwd's weights)."""
    lags = [trainer_version - s.proximal_version for s in samples if s.proximal_version is not None]
    return {"proximal_staleness_mean": sum(lags) / len(lags), "proximal_staleness_max": float(max(lags))} if lags else {}


def distillation_metrics(samples: list[Sample]) -> dict[str, float]:
    """Token-mean of log pi_student - log pi_teacher on the student's samples: the reverse KL estimate."""
    pairs = [(s.rollout_logprobs, s.teacher_logprobs) for s in samples if s.teacher_logprobs is not None]
    gaps = [st - te for student, teacher in pairs for st, te in zip(student, teacher)]
    return {"distill_reverse_kl": sum(gaps) / len(gaps)} if gaps else {}
