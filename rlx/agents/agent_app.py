"""Agent-app mode: a user's agent program plays one episode per dataset row against the policy.

The program is `package.module:function` with the signature

    def play(base_url: str, api_key: str, row: dict) -> float      # `async def` works too

It talks to the policy through the ordinary `openai` client
(`OpenAI(base_url=base_url, api_key=api_key)`) or any framework on top of it, and returns the
episode's reward. `row` is the dataset row as {"prompt", "label", "metadata"}.

Each episode runs in a process of the reward pool (`rlx.rewards.pool.RewardPool`), the same
killable isolation as user reward code: a program that raises, calls sys.exit, hangs past the
episode's deadline (its process group is killed) or returns anything but a finite number fails
only its own episode, which is counted and never stops the run. What the episode's calls produced
is recorded by the server (`rlx.agents.openai_server`), merged into trajectories
(`rlx.agents.episodes`) and returned with the reward, which every trajectory of the episode also
carries as its `env_reward` (what `reward.name=environment` scores). The deadline counts from the
call: starting a process and importing the app are not part of it.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

from rlx.agents.episodes import EpisodeResult, merge_calls
from rlx.agents.openai_server import AgentServer
from rlx.data.rows import PromptRow
from rlx.errors import ConfigError
from rlx.rewards import load_custom_reward
from rlx.rewards.pool import RewardFailure, RewardPool, RewardSpec
from rlx.rewards.safe import bounded, check_score

SETTING = "rollout.agent_app"
TIMEOUT_SETTING = "rollout.agent_app_timeout_s"


def app_row(row: PromptRow) -> dict[str, Any]:
    """A dataset row as an agent program receives it (plain data: it crosses a process boundary)."""
    return {"prompt": row.prompt, "label": row.label, "metadata": dict(row.metadata)}


def check_app(app: str) -> None:
    """Fail at start-up, naming the setting, if `app` cannot be imported or called as the signature says."""
    if ":" not in app:
        raise ConfigError(f"{SETTING}={app!r} must be package.module:function")
    fn = load_custom_reward(app, SETTING)
    try:
        inspect.signature(fn).bind("base_url", "api_key", {})
    except TypeError as error:
        raise ConfigError(f"{SETTING}={app!r} must take (base_url, api_key, row): {error}") from None
    except ValueError:  # a builtin or C function without a signature: the first call will tell
        pass


class AgentAppRunner:
    """Runs episodes of one agent program against one server; `run_episode` is safe from any thread.

    `failures` counts failed episodes by class: error, timeout, crash, bad_value, no_calls, limit."""

    def __init__(self, server: AgentServer, app: str, timeout_s: float, max_workers: int = 8,
                 pool: RewardPool | None = None) -> None:
        check_app(app)
        self.server, self.timeout_s = server, timeout_s
        self.spec = RewardSpec(app, "none", None, tuple(sys.path))  # the pool builds `app` from this spec
        self.pool = pool or RewardPool(max_workers, confined=False)  # the app must reach the server
        self._owns_pool = pool is None
        self.failures: Counter[str] = Counter()
        self._lock = threading.Lock()  # episodes finish on many threads

    def run_episode(self, row: dict[str, Any]) -> EpisodeResult:
        episode_id = self.server.open_episode()
        result = EpisodeResult(episode_id, row)
        start = time.monotonic()
        try:
            value = self.pool.call(self.spec, (self.server.base_url(episode_id), self.server.token, row),
                                   self.timeout_s, TIMEOUT_SETTING)
        except RewardFailure as failure:
            value = None
            result.failure, result.error = failure.kind, bounded(f"the agent app failed: {failure}")
        finally:
            ended = self.server.close_episode(episode_id)
        calls = ended.calls
        result.duration_s = time.monotonic() - start
        result.calls, result.trajectories = len(calls), merge_calls(calls)
        if ended.refused is not None:  # whatever the app made of the refusal, the episode went past a limit
            result.failure, result.error = "limit", f"the agent app went past a limit: {ended.refused}"
        elif result.failure is None:
            score = check_score(value)
            if score.failed:
                result.failure, result.error = score.kind, f"the agent app returned a {score.error}"
            elif not calls:
                result.failure, result.error = "no_calls", "the agent app returned a reward but never called the model"
            else:
                result.reward = score.score
                for trajectory in result.trajectories:  # shared: what reward.name=environment reads
                    trajectory.env_reward = score.score
        if result.failure is not None:
            with self._lock:
                self.failures[result.failure] += 1
        return result

    def run_episodes(self, rows: Sequence[dict[str, Any]]) -> list[EpisodeResult]:
        """One episode per row, up to the pool's size at once; results in row order."""
        if not rows:
            return []
        with ThreadPoolExecutor(min(len(rows), self.pool.max_workers), thread_name_prefix="rlx-episode") as threads:
            return list(threads.map(self.run_episode, rows))

    def close(self) -> None:
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_episodes(server: AgentServer, app: str, rows: Sequence[dict[str, Any]], timeout_s: float,
                 max_workers: int = 8) -> list[EpisodeResult]:
    """One-shot: a runner with its own process pool, closed when the episodes are done."""
    with AgentAppRunner(server, app, timeout_s, max_workers) as runner:
        return runner.run_episodes(rows)
