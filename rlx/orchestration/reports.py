"""What a training step reports: its sample statistics, and the reports a worker holds until the
driver has them (a reply lost to a timeout is handed out again, never lost)."""

from __future__ import annotations

import uuid
from collections import Counter

from rlx.agents.trajectory import CUT_REASONS
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
        **agent_metrics(samples),
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


def agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """Multi-turn rollouts: turns, tool calls by tool and outcome, tool latency, trajectories cut by
    a limit, the fraction of response tokens masked out of the loss (observations), and the
    observations that showed media."""
    stats = [s.agent_stats for s in samples if s.agent_stats is not None]
    if not stats:
        return {}
    calls = [call for entry in stats for call in entry["tool_calls"]]
    tokens = sum(len(s.response_ids) for s in samples if s.agent_stats is not None)
    metrics = {
        "agent_turns_mean": sum(entry["turns"] for entry in stats) / len(stats),
        "agent_tool_calls_mean": len(calls) / len(stats),
        "agent_cut_fraction": sum(s.finish_reason in CUT_REASONS
                                  for s in samples if s.agent_stats is not None) / len(stats),
        "agent_masked_token_fraction": sum(entry["masked_tokens"] for entry in stats) / max(1, tokens),
        # agent apps: an episode whose calls do not all continue one conversation makes several samples
        "agent_samples_per_episode": len(stats) / sum(1 / s.episode_rows for s in samples if s.agent_stats is not None),
    }
    if shown := sum(entry.get("observations_with_media", 0) for entry in stats):  # environments that show media
        metrics["agent_media_observations_mean"] = shown / len(stats)
    if calls:
        metrics["agent_tool_latency_mean_s"] = sum(latency for _, _, latency in calls) / len(calls)
    for (tool, outcome), count in sorted(Counter((tool, outcome) for tool, outcome, _ in calls).items()):
        metrics[f"agent_tool_{tool}_{outcome}"] = float(count)
    return metrics
