"""Agent-app episodes: every model call an episode makes, recorded server-side, and the merge rule.

An outside agent program talks to the policy through the OpenAI-compatible server, which renders
each request's messages and generates; the program never handles token ids. So the server keeps,
per episode, each call's prompt ids exactly as it rendered them and the completion ids and
log-probs exactly as the engine generated them. When the episode ends, its calls become
trajectories:
- a call whose prompt extends an earlier call's whole context (its prompt + completion) token for
  token continues that trajectory: the tokens in between (the template's end of turn, tool results,
  the next user message) are observations, masked out of the loss;
- any other call starts a trajectory of its own (prompt as rendered, completion exact).
The first rule is what a chat that re-sends its history produces when the template re-renders the
policy's earlier turns as the same tokens; when it does not (a template that rewrites earlier
turns, content the program edited, a stop string cut from the text), the calls stay separate
samples, still exact. Every trajectory of an episode shares its reward.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlx.agents.trajectory import Trajectory


@dataclass(frozen=True)
class CallRecord:
    """One model call of an episode, as the engine saw it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: int  # weights of the first completion token
    last_weight_version: int  # weights of the last one (newer if weights loaded mid-call)
    finish_reason: str  # the engine's: stop or length
    text: str  # the completion as the program received it
    temperature: float  # what it was sampled at: the trainer must score it at the same temperature


class EpisodeClosed(KeyError):
    """The episode is unknown or has ended: a call for it is refused (404), a late one not recorded."""


@dataclass(frozen=True)
class EpisodeCalls:
    """What an episode recorded, and the first call a limit refused (its message), if one did."""

    calls: list[CallRecord]
    refused: str | None = None


class EpisodeRecorder:
    """The calls of one open episode, in the order they finished; safe from any thread."""

    def __init__(self, episode_id: str) -> None:
        self.episode_id = episode_id
        self._calls: list[CallRecord] = []
        self._lock = threading.Lock()
        self._open = True
        self._admitted = 0
        self._refused: str | None = None

    def admit(self, max_calls: int | None) -> bool:
        """Count a call about to generate; False once `max_calls` were admitted."""
        with self._lock:
            if max_calls is not None and self._admitted >= max_calls:
                return False
            self._admitted += 1
            return True

    def refuse(self, reason: str) -> None:
        """A limit refused a call: the episode ends there (the first reason is kept)."""
        with self._lock:
            self._refused = self._refused or reason

    @property
    def refused(self) -> str | None:
        with self._lock:
            return self._refused

    def calls(self) -> list[CallRecord]:
        with self._lock:
            return list(self._calls)

    def record(self, call: CallRecord) -> None:
        """Raises EpisodeClosed for a call that finished after the episode ended: it is not kept."""
        with self._lock:
            if not self._open:
                raise EpisodeClosed(self.episode_id)
            self._calls.append(call)

    def close(self) -> EpisodeCalls:
        with self._lock:
            self._open = False
            return EpisodeCalls(list(self._calls), self._refused)


class Episodes:
    """The open episodes of one server, by id."""

    def __init__(self) -> None:
        self._open: dict[str, EpisodeRecorder] = {}
        self._lock = threading.Lock()

    def open(self, episode_id: str) -> None:
        with self._lock:
            if episode_id in self._open:
                raise ValueError(f"episode {episode_id!r} is already open")
            self._open[episode_id] = EpisodeRecorder(episode_id)

    def get(self, episode_id: str) -> EpisodeRecorder:
        with self._lock:
            recorder = self._open.get(episode_id)
        if recorder is None:
            raise EpisodeClosed(episode_id)
        return recorder

    def close(self, episode_id: str) -> EpisodeCalls:
        """The episode's calls; later calls for it are refused and late ones dropped."""
        with self._lock:
            recorder = self._open.pop(episode_id, None)
        if recorder is None:
            raise EpisodeClosed(episode_id)
        return recorder.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


def continued(trajectories: list[Trajectory], prompt_ids: list[int]) -> Trajectory | None:
    """The trajectory whose whole context `prompt_ids` starts with: the longest, the latest on a tie."""
    best: Trajectory | None = None
    for trajectory in trajectories:
        context = trajectory.context_ids
        extends = len(context) <= len(prompt_ids) and prompt_ids[:len(context)] == context
        if extends and (best is None or len(context) >= len(best.context_ids)):
            best = trajectory
    return best


def merge_calls(calls: Sequence[CallRecord]) -> list[Trajectory]:
    """Calls (in the order they finished) -> trajectories, by the rule in the module docstring."""
    trajectories: list[Trajectory] = []
    for call in calls:
        trajectory = continued(trajectories, call.prompt_ids)
        if trajectory is None:
            trajectory = Trajectory(list(call.prompt_ids))
            trajectories.append(trajectory)
        else:
            trajectory.add_observation(call.prompt_ids[len(trajectory.context_ids):])
        trajectory.add_policy(list(call.completion_ids), list(call.logprobs), call.weight_version,
                              call.last_weight_version)
        trajectory.finish_reason = call.finish_reason
        trajectory.final_text = call.text
    return trajectories


@dataclass
class EpisodeResult:
    """One dataset row's episode. `reward` is None when the episode failed: then `failure` is its
    class (error, timeout, crash, bad_value, no_calls, limit) and `error` says why; a failed episode's
    trajectories are returned for metrics but carry no reward to train on."""

    episode_id: str
    row: dict[str, Any]
    trajectories: list[Trajectory] = field(default_factory=list)
    reward: float | None = None
    failure: str | None = None
    error: str | None = None
    calls: int = 0
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure is None
