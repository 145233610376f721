"""Multi-turn rollouts: each trajectory alternates policy turns and environment steps.

Every trajectory runs on a thread of its own and submits each policy turn to one `EngineLoop`,
which batches whatever turns are waiting. A turn that ends in a tool call leaves the batch when it
finishes, so its slot goes to another trajectory while the tool runs; the next turn comes back as a
new request with the whole context (token ids, never text). Tools of different trajectories run
concurrently, on their trajectories' threads.

Media: a row's images, audio or video reach the opening prompt (its placeholders expanded by the
rollout's processor, once per group) and go with every turn's request, since each turn prefills
the whole context. An observation may show media of its own (`EnvStep.media`): the processor
expands its placeholders and encodes its items, and from then on every request carries them after
the opening's (one part per observation, so the group's shared opening stays one object).

Prefix reuse: the `hf` engine prefills the whole context again for each turn (it keeps no cache
between requests). vLLM reuses the prefix's KV cache with `rollout.engine_options:
{enable_prefix_caching: true}`; rlx leaves it off by default, because a prefix cached before a
weight load holds KV computed with the older weights, and vLLM clears its cache only when idle.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlx.agents.chat import ChatTokens, TemplateDrift, check_template
from rlx.agents.environments import Environment, EnvironmentFactory, opening_messages
from rlx.agents.trajectory import Trajectory
from rlx.config import MEDIA_MODALITIES
from rlx.data.media import row_media
from rlx.data.prompts import with_model_placeholders
from rlx.data.rows import DataError, Messages, PromptRow
from rlx.data.sample import Sample
from rlx.engines.generation.base import SamplingParams
from rlx.engines.generation.engine_loop import EngineLoop
from rlx.media.inputs import MediaInputs
from rlx.rewards.safe import bounded
from rlx.roles.rollout import Group, Rollout

if TYPE_CHECKING:
    from rlx.media.processor import MediaProcessor

log = logging.getLogger(__name__)
HEARTBEAT_S = 0.2  # while every trajectory waits on a tool, the engine still gets `between_steps` this often


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int  # policy turns per trajectory
    max_trajectory_tokens: int  # response tokens (policy and observation) per trajectory


class ConcurrentRollout(Rollout, abc.ABC):
    """Runs every response (a trajectory, an episode) on a thread of its own against one EngineLoop,
    and yields its samples when it ends. `generate` has Rollout's contract, except that an episode
    of several trajectories yields them all, numbered by `Sample.episode` (see `episode_samples`)."""

    def __init__(self, engine, tokenizer, concurrency: int, processor: MediaProcessor | None = None) -> None:
        super().__init__(engine, tokenizer, processor)
        self.concurrency = concurrency

    @abc.abstractmethod
    def respond(self, loop: EngineLoop, row: PromptRow, params: SamplingParams) -> list[Trajectory]:
        """One whole response to `row` (an episode): its trajectories, at least one. Each becomes a
        sample; an episode's samples share its reward and count as one response of the group."""

    @contextlib.contextmanager
    def session(self, loop: EngineLoop, params: SamplingParams) -> Iterator[None]:
        """What lives as long as one `generate` call (an HTTP endpoint): nothing by default."""
        yield

    def generate(self, groups: list[Group], n: int, params: SamplingParams,
                 more_groups: Callable[[int], list[Group]] | None = None,
                 between_steps: Callable[[], None] | None = None) -> Iterator[Sample]:
        loop = EngineLoop(self.engine)
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="rlx-response")
        running: dict[Future, tuple[int, int, PromptRow]] = {}

        def start(new_groups: list[Group]) -> None:
            for group_id, row, _ in new_groups:
                for episode in range(n):
                    running[pool.submit(self.respond, loop, row, params)] = (episode, group_id, row)

        try:
            with self.session(loop, params):
                start(groups)
                while running:
                    done, _ = wait(running, timeout=HEARTBEAT_S, return_when=FIRST_COMPLETED)
                    for future in done:
                        episode, group_id, row = running.pop(future)
                        yield from self.episode_samples(episode, group_id, row, future.result())
                    if between_steps is not None:
                        loop.run_on_engine_thread(between_steps)
                    free = self.concurrency - len(running)
                    if more_groups is not None and free >= n:
                        start(more_groups(free // n))
        finally:
            loop.stop()
            for future in running:
                future.cancel()
            pool.shutdown(wait=True)

    def episode_samples(self, episode: int, group_id: int, row: PromptRow,
                        trajectories: list[Trajectory]) -> list[Sample]:
        """One sample per trajectory, each tagged with the episode's number in its group and its
        sample count: an episode of several (an agent app whose calls do not all continue one
        conversation) counts once in group advantages, and the bus knows when its group is whole."""
        samples = [trajectory_sample(next(self._uids), group_id, row, t) for t in trajectories]
        for sample in samples:
            sample.episode, sample.episode_rows = episode, len(samples)
        return samples


class AgentRollout(ConcurrentRollout):
    """Trajectories against an environment: policy turns and environment steps, turn by turn."""

    def __init__(self, engine, tokenizer, environments: EnvironmentFactory, limits: TurnLimits,
                 concurrency: int, processor: MediaProcessor | None = None) -> None:
        super().__init__(engine, tokenizer, concurrency, processor)
        self.environments, self.limits = environments, limits
        # a group's trajectories open alike: their media is processed once, by the first to open, while
        # the others wait for it (at most one group per trajectory in flight is kept; one evicted early
        # is only processed again)
        self._opened: OrderedDict[tuple[int, tuple[int, ...]], tuple[PromptRow, Future]] = OrderedDict()
        self._opened_lock = threading.Lock()
        probe = environments()
        # the model's media tokens stay ids in observations: `_shown` refuses a stray one
        media_tokens = tokenizer.convert_ids_to_tokens(sorted(processor.media_token_ids)) if processor else ()
        self.chat = ChatTokens(tokenizer, probe.tool_specs, media_tokens)
        probe.close()
        self.template_check = check_template(self.chat)  # reported at start-up; see rlx.agents.chat

    def respond(self, loop: EngineLoop, row: PromptRow, params: SamplingParams) -> list[Trajectory]:
        try:
            env = self.environments()
        except BaseException as error:  # noqa: BLE001 - user environment code (sys.exit too); the sample carries it
            return [self._not_started(row, "start", error)]
        try:
            return [self._play(env, loop, row, params)]
        finally:
            env.close()

    def _not_started(self, row: PromptRow, stage: str, error: BaseException) -> Trajectory:
        """The sample of an episode whose environment could not start: the row's prompt, no response,
        the reason; at the engine's current version, so it counts as on time."""
        reason = bounded(f"{type(error).__name__}: {error}")
        log.warning("environment %s failed: %s", stage, reason)
        version = self.engine.weight_version
        messages = opening_messages(row, None, ())
        try:
            prompt_ids, media = self._opening(messages, row)
        except DataError:  # the row's media itself: the sample is text, and fails
            prompt_ids, media = self.chat.prompt_ids(messages), None
        trajectory = Trajectory(prompt_ids, finish_reason="env_error", behavior_version=version,
                                last_behavior_version=version, media=media)
        trajectory.env_error = reason
        return trajectory

    def _play(self, env: Environment, loop: EngineLoop, row: PromptRow, params: SamplingParams) -> Trajectory:
        try:
            messages = env.reset(row)
        except BaseException as error:  # noqa: BLE001 - user environment code (sys.exit too); the sample carries it
            return self._not_started(row, "reset", error)
        try:
            prompt_ids, media = self._opening(messages, row)
        except DataError as error:  # media the processor refuses, or an opening that lost a placeholder
            return self._not_started(row, "media", error)
        trajectory = Trajectory(prompt_ids, media=media)
        limits = self.limits
        while True:
            budget = limits.max_trajectory_tokens - len(trajectory.response_ids)
            turn_params = params if budget >= params.max_new_tokens else dataclasses.replace(params, max_new_tokens=budget)
            result = loop.submit(trajectory.context_ids, turn_params, trajectory.request_media).result()
            trajectory.add_policy(result.response_ids, result.logprobs, result.weight_version,
                                  result.extra.get("last_weight_version"), result.routed_experts)
            text = self.chat.turn_text(result.response_ids)
            trajectory.final_text = text
            if result.finish_reason == "length":  # a cut turn is no action
                return _finish(trajectory, "length" if budget >= params.max_new_tokens else "max_tokens")
            try:
                step = env.step(text)
            except BaseException as error:  # noqa: BLE001 - user environment code (sys.exit too): the trajectory ends
                trajectory.env_error = bounded(f"{type(error).__name__}: {error}")
                log.warning("environment step failed: %s", trajectory.env_error)
                return _finish(trajectory, "env_error")
            trajectory.tool_calls += step.tool_calls
            if step.reward is not None:
                trajectory.env_reward = step.reward
            if step.done:
                return _finish(trajectory, "stop")
            if trajectory.turns >= limits.max_turns:
                return _finish(trajectory, "max_turns")
            try:
                observation = self.chat.observation_ids(messages, result.response_ids, step.observation,
                                                        self.placeholder_text if step.media else None)
            except TemplateDrift:
                return _finish(trajectory, "template_drift")
            except DataError as error:  # control token text the template would not write verbatim
                trajectory.env_error = bounded(str(error))
                return _finish(trajectory, "env_error")
            try:
                observation, shown = self._shown(row, trajectory.turns, observation, step.media)
            except DataError as error:  # media the environment got wrong fail its trajectory only
                log.warning("environment media refused: %s", error)
                trajectory.env_error = str(error)
                return _finish(trajectory, "env_error")
            if len(trajectory.response_ids) + len(observation) >= limits.max_trajectory_tokens:
                return _finish(trajectory, "max_tokens")  # never cut: a media span stays whole
            trajectory.add_observation(observation, shown)
            messages = [*messages, {"role": "assistant", "content": text}, *step.observation]

    def _shown(self, row: PromptRow, turn: int, ids: list[int], media: dict[str, list[Any]],
               ) -> tuple[list[int], MediaInputs | None]:
        """An observation's ids with the placeholders of the media it shows expanded, and that
        media as model inputs; refused, naming the row and turn, if the two do not match."""
        where = f"{row.source or 'row'}: the environment's observation after turn {turn}"
        # the model's media tokens are the processor's to write: a placeholder or marker the text holds
        # by itself stands for an item that is not there, and would break the batch's forward
        if self.processor is not None:
            allowed = set(self.processor.placeholder_ids.values()) if media else set()
            if stray := set(ids).intersection(self.processor.media_token_ids) - allowed:
                raise DataError(f"{where} holds the model's media token(s) {sorted(stray)}"
                                f"{'' if media else ' but shows no media'}: write one placeholder (<image>, "
                                "<audio>, <video>) per item of EnvStep.media and keep the model's own media "
                                "tokens out of the text")
        if not media:
            return ids, None
        if self.processor is None:
            raise DataError(f"{where} shows media, but the run has no media processor: set data.media_keys "
                            "(e.g. {image: images}; rows need not carry any) with a model that takes media")
        if unknown := set(media) - set(MEDIA_MODALITIES):
            raise DataError(f"{where}: EnvStep.media has {sorted(unknown)}; its keys are {', '.join(MEDIA_MODALITIES)}")
        limits = self.processor.limits
        shown = PromptRow(prompt="", label="", source=where,
                          media=row_media(media, where, {kind: kind for kind in media}, limits, limits.root_dir))
        return self.processor(ids, shown)

    def _opening(self, messages: Messages, row: PromptRow) -> tuple[list[int], MediaInputs | None]:
        """The opening prompt's ids; with the row's media, each dataset placeholder (`<image>`) as the
        model's own token expanded to the item's tokens, and the media as model inputs."""
        if not row.media:
            return self.chat.prompt_ids(messages), None
        ids = self.chat.encode(with_model_placeholders(self.chat.render(messages, add_generation_prompt=True),
                                                       self.placeholder_text))
        key = (id(row), tuple(ids))
        with self._opened_lock:
            first = key not in self._opened
            if first:
                self._opened[key] = (row, Future())  # the row kept alive: its id stays its own
                while len(self._opened) > self.concurrency:
                    self._opened.popitem(last=False)
            _, opened = self._opened[key]
        if first:
            try:
                opened.set_result(self.prepare(row, ids))
            except BaseException as error:  # noqa: BLE001 - raised below, in every trajectory of the group
                with self._opened_lock:  # not kept: a later trajectory of the row tries again
                    if self._opened.get(key, (None, None))[1] is opened:
                        del self._opened[key]
                opened.set_exception(error)
        try:
            return opened.result()
        except DataError as error:  # each trajectory raises its own (one shared object would collect
            raise DataError(str(error)) from None  # every raiser's traceback)


def _finish(trajectory: Trajectory, reason: str) -> Trajectory:
    trajectory.finish_reason = reason
    return trajectory


def trajectory_sample(uid: int, group_id: int, row: PromptRow, trajectory: Trajectory) -> Sample:
    metadata = dict(row.metadata)
    if trajectory.env_reward is not None:
        metadata["env_reward"] = trajectory.env_reward
    if trajectory.env_error is not None:
        metadata["env_error"] = trajectory.env_error
    return Sample(
        uid=uid, group_id=group_id, prompt_ids=trajectory.prompt_ids, response_ids=trajectory.response_ids,
        rollout_logprobs=trajectory.logprobs, loss_mask=trajectory.loss_mask,
        behavior_version=trajectory.behavior_version or 0, last_behavior_version=trajectory.last_behavior_version,
        finish_reason=trajectory.finish_reason, response_text=trajectory.final_text, prompt_text=row.question,
        label=row.label, metadata=metadata, agent_stats=trajectory_stats(trajectory),
        routed_experts=trajectory.routed_experts, media_inputs=trajectory.media,
        observed_media=tuple(trajectory.observed_media) or None)


def trajectory_stats(trajectory: Trajectory) -> dict:
    """What the trainer's metrics need of a trajectory (a bus field: JSON-safe)."""
    return {"turns": trajectory.turns, "masked_tokens": trajectory.masked_tokens,
            "observations_with_media": len(trajectory.observed_media),
            "tool_calls": [[c.tool, c.outcome, round(c.latency_s, 4)] for c in trajectory.tool_calls]}

