"""Agent-app rollouts: a user's agent program plays each episode through the OpenAI-compatible
endpoint, and the calls it made become its samples.

An episode is one response of its group. Its calls become trajectories by `merge_calls` (a chat app
that continues its conversation merges all its calls into one); each trajectory is a sample, and
an episode of several is tagged so that group advantages count it once (`Sample.episode`). A
failed episode (the app raised, hung, returned garbage or never called the model) still yields its
samples, with the failure in `metadata.env_error`, which `reward.name=environment` turns into a
failed reward: it is counted and never trained on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from rlx.agents.agent_app import AgentAppRunner, app_row, check_app
from rlx.agents.chat import ChatTokens
from rlx.agents.episodes import EpisodeResult
from rlx.agents.loop import ConcurrentRollout
from rlx.agents.openai_server import AgentServer, ServerLimits
from rlx.agents.trajectory import Trajectory
from rlx.data.rows import PromptRow
from rlx.engines.generation.base import SamplingParams
from rlx.engines.generation.engine_loop import EngineLoop
from rlx.rewards.pool import RewardPool


class AgentAppRollout(ConcurrentRollout):
    def __init__(self, engine, tokenizer, app: str, timeout_s: float, concurrency: int,
                 limits: ServerLimits | None = None) -> None:
        """`limits`: an episode's (rollout.agent_app_max_*); the per-call ones come from each `generate`."""
        super().__init__(engine, tokenizer, concurrency)
        check_app(app)
        self.app, self.timeout_s, self.limits = app, timeout_s, limits or ServerLimits()
        self.chat = ChatTokens(tokenizer)
        self.pool = RewardPool(concurrency, confined=False)  # warm from one `generate` to the next; reaches the server
        self._runner: AgentAppRunner | None = None

    @contextlib.contextmanager
    def session(self, loop: EngineLoop, params: SamplingParams) -> Iterator[None]:
        """The endpoint lives as long as one `generate`; every call samples at the rollout's settings,
        so the trainer's log-probs (at `rollout.temperature`) are those the engine sampled from."""
        limits = dataclasses.replace(self.limits, max_tokens=params.max_new_tokens, temperature=params.temperature)
        with AgentServer(loop, self.tokenizer, limits) as server:
            self._runner = AgentAppRunner(server, self.app, self.timeout_s, self.concurrency, pool=self.pool)
            try:
                yield
            finally:
                self._runner = None

    def respond(self, loop: EngineLoop, row: PromptRow, params: SamplingParams) -> list[Trajectory]:
        assert self._runner is not None, "respond runs inside generate's session"
        return self.episode_trajectories(self._runner.run_episode(app_row(row)), row)

    def episode_trajectories(self, episode: EpisodeResult, row: PromptRow) -> list[Trajectory]:
        trajectories = episode.trajectories
        if not trajectories:  # nothing to train on: the sample only carries the failure
            prompt = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
            trajectories = [Trajectory(self.chat.prompt_ids(prompt), finish_reason="no_calls")]
        if not episode.ok:
            for trajectory in trajectories:
                trajectory.env_reward, trajectory.env_error = None, f"{episode.failure}: {episode.error}"
        return trajectories
