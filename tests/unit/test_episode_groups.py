"""Groups whose size varies: an agent app's episode may make several samples (its calls do not all
continue one conversation). The group is one prompt's `n` episodes whatever its rows: the bus
knows when it is whole from the size its producer declares, group advantages count each episode
once, and training steps count responses, not rows."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from rlx.algorithms.advantages import grpo_advantages
from rlx.bus.core import BusIndex
from rlx.bus.loader import StreamingDataLoader
from rlx.bus.local import LocalBus
from rlx.config import AlgorithmConfig
from rlx.data.sample import Sample
from rlx.orchestration.plan import FIELDS
from rlx.orchestration.resume import resume_plan
from rlx.orchestration.workers import response_shares
from rlx.roles.advantages import Advantages, episodes

N = 3  # episodes per group


def _put_episode(bus: LocalBus, group: int, samples: int, declared: int) -> list[int]:
    """What the rollout worker does with an episode: raise the group's size first, then its rows."""
    if samples > 1:
        bus.put_group(group, {}, rows=declared)
    return bus.put({"reward": [1.0] * samples, "episode_rows": [samples] * samples}, group_ids=[group] * samples)


def test_a_grown_group_is_whole_only_once_every_episode_is_in():
    bus = LocalBus(check_schema=FIELDS)

    def taken() -> list[int]:
        return bus.poll("advantages", ["reward"], N, timeout=0.01, sampler=("group", N))[0]

    rows = _put_episode(bus, 5, samples=2, declared=N + 1)
    assert taken() == []
    rows += _put_episode(bus, 5, samples=2, declared=N + 2)
    assert taken() == [], "4 rows (more than n) of a group declared at 5 are not a whole group"
    _put_episode(bus, 7, samples=2, declared=N + 1)
    _put_episode(bus, 7, samples=1, declared=N + 1)  # n rows by coincidence, one episode still to come
    plain = bus.put({"reward": [0.0] * N}, group_ids=[6] * N)
    assert taken() == plain, "a plain group beside it is whole at n rows, as before"
    rows += _put_episode(bus, 5, samples=1, declared=N + 2)
    assert {c.group_id: c.group_rows for c in bus.index.ready("advantages", ["reward"])} == {5: N + 2, 7: N + 1}
    assert sorted(taken()) == rows, "batch_size asks for groups: the whole group of 5 rows"


def test_a_dead_producer_abandons_a_grown_group_short_of_its_declared_rows_and_resume_redoes_it():
    bus = LocalBus(check_schema=FIELDS)
    _put_episode(bus, 1, samples=2, declared=N + 1)
    _put_episode(bus, 1, samples=2, declared=N + 2)  # 4 rows: more than n, short of the 5 declared
    whole = [*_put_episode(bus, 2, samples=2, declared=N + 1), *_put_episode(bus, 2, samples=1, declared=N + 1),
             *_put_episode(bus, 2, samples=1, declared=N + 1)]
    snapshot = bus.index.snapshot()
    bus_state, prompts = resume_plan({"bus": snapshot, "prompts": {"position": 3, "unfinished": [1, 2]}}, N,
                                     {}, frozenset())
    assert prompts["unfinished"] == [1] and sorted(BusIndex.restore(bus_state).rows) == whole
    assert bus.abandon_incomplete_groups([1, 2], group_size=N) == [1]
    assert sorted(r for r in bus.index.rows) == whole


def test_group_advantages_count_an_episode_once_whatever_its_samples():
    # group 0: episode 0 scored 1 and made three samples, episode 1 scored 0 and made one;
    # group 1: two plain samples (no episode tag), each its own response
    tags = [(0, 0, 1.0), (0, 0, 1.0), (0, 0, 1.0), (0, 1, 0.0), (1, None, 2.0), (1, None, 0.0)]
    samples = [Sample(uid=i, group_id=g, response_ids=[1], episode=e, reward=r) for i, (g, e, r) in enumerate(tags)]
    assert episodes(samples) == ([0, 0, 0, 1, 2, 3], [0, 3, 4, 5])
    Advantages(AlgorithmConfig(advantage="grpo"), filter_zero_std=False).compute(samples)
    per_episode = grpo_advantages(torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.tensor([0, 0, 1, 1]))
    expected = per_episode[[0, 0, 0, 1, 2, 3]].tolist()
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-6)
    # by hand: two responses per group, rewards {1, 0} -> +-0.5 / std(unbiased) = +-0.7071
    assert expected[0] == pytest.approx(0.70710, abs=1e-4) and expected[3] == pytest.approx(-0.70710, abs=1e-4)
    # counting rows instead would weigh episode 0 three times: mean 0.75, and a different advantage
    by_rows = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long))
    assert abs(by_rows[0].item() - expected[0]) > 0.1


def test_a_training_step_takes_responses_in_shares_of_their_episodes():
    bus = LocalBus(check_schema=FIELDS)
    episode_rows = [3, 3, 3, 1, 2, 2, 1, 1]  # four responses of steps of 2: (3+1), (2+1), (1 + one more)
    bus.put({"episode_rows": episode_rows}, group_ids=list(range(len(episode_rows))))
    steps = []
    for _ in range(2):
        loader = StreamingDataLoader(bus, "train", ["episode_rows"], micro_batch_size=2, rows_per_step=2, timeout=1,
                                     counts=lambda values: sum(response_shares(values, 0)))
        steps.append([v for _, values in loader for v in values["episode_rows"]])
    assert steps == [[3, 3, 3, 1], [2, 2, 1]], "a step ends at exactly two responses: thirds add up to one"
    assert response_shares({"reward": [0.0, 1.0]}, 2) == [1, 1], "rows without episodes are one each"


def _steps(bus: LocalBus) -> list[list[int]]:
    """Consecutive steps of one response each, as the Actor takes them: what a step took beyond its
    count (`remaining` below 0) comes off the next one."""
    steps, overshoot = [], Fraction(0)
    while bus.index.ready("train", ["episode_rows"]):
        loader = StreamingDataLoader(bus, "train", ["episode_rows"], micro_batch_size=4, rows_per_step=1 + overshoot,
                                     timeout=1, counts=lambda values: sum(response_shares(values, 0)))
        steps.append([v for _, values in loader for v in values["episode_rows"]])
        overshoot = min(Fraction(0), loader.remaining)
    return steps


def test_shares_are_exact_and_a_step_that_took_too_much_leaves_less_to_the_next():
    bus = LocalBus(check_schema=FIELDS)  # 8 episodes of 3 samples in micro-batches of 4: floats would leave a sliver and take a 25th row
    bus.put({"episode_rows": [3] * 24}, group_ids=[g // 3 for g in range(24)])
    loader = StreamingDataLoader(bus, "train", ["episode_rows"], micro_batch_size=4, rows_per_step=8, timeout=1,
                                 counts=lambda values: sum(response_shares(values, 0)))
    assert sum(len(rows) for rows, _ in loader) == 24 and loader.remaining == 0
    # an episode's third sample arrives after a plain response: the first step ends on that whole
    # response (2/3 too much), and the second takes only the third sample
    bus = LocalBus(check_schema=FIELDS)
    bus.put({"episode_rows": [3, 3, 1, 3]}, group_ids=[0, 0, 1, 0])
    assert _steps(bus) == [[3, 3, 1], [3]]
