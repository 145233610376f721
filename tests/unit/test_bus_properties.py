"""Property tests of the bus index under random production/consumption interleavings."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rlx.bus.core import BusFull, BusIndex
from rlx.bus.samplers import GroupSampler, SequentialSampler, TokenBudgetSampler

GROUP = 3
TASKS = {"reward": ["response"], "train": ["response", "reward"]}


class BusMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bus = BusIndex(capacity=30)
        self.next_group = 0
        self.added: set[int] = set()
        self.taken: dict[str, list[int]] = {task: [] for task in TASKS}
        self.groups_of: dict[int, int] = {}

    @rule(groups=st.integers(1, 3), reserved=st.booleans())
    def produce(self, groups, reserved):
        """`reserved`: the producer names its rows with ids reserved beforehand (the Ray bus's clients)."""
        group_ids = [self.next_group + g for g in range(groups) for _ in range(GROUP)]
        ids = None
        if reserved:
            first = self.bus.reserve(len(group_ids))
            ids = list(range(first, first + len(group_ids)))
        try:
            rows = self.bus.add_rows({"response": [f"r{i}" for i in range(len(group_ids))]}, group_ids,
                                     [5] * len(group_ids), ids)
        except BusFull:
            assert len(self.bus.rows) + len(group_ids) > self.bus.capacity
            return
        self.next_group += groups
        self.added.update(rows)
        self.groups_of.update(zip(rows, group_ids))

    @rule(data=st.data())
    def score(self, data):
        rows = self.bus.take("reward", TASKS["reward"], data.draw(st.integers(1, 4)), SequentialSampler(),
                             partial=data.draw(st.booleans()))
        self.taken["reward"].extend(rows)
        if rows:
            self.bus.add_fields(rows, {"reward": [1.0] * len(rows)})

    @rule(groups=st.integers(1, 2), partial=st.booleans())
    def train_groups(self, groups, partial):
        rows = self.bus.take("train", TASKS["train"], groups * GROUP, GroupSampler(GROUP), partial)
        per_group: dict[int, int] = {}
        for row in rows:
            per_group[self.groups_of[row]] = per_group.get(self.groups_of[row], 0) + 1
        assert all(count == GROUP for count in per_group.values()), "a group was split"
        assert set(self.bus.values(rows, ["reward"])["reward"]) <= {1.0}
        self.taken["train"].extend(rows)

    @rule(budget=st.integers(1, 20))
    def peek_tokens(self, budget):
        """Token-budget sampling never exceeds the budget except to return a single row."""
        ready = self.bus.ready("train", TASKS["train"])
        chosen = TokenBudgetSampler(budget).select(ready, 100, partial=True)
        assert len(chosen) <= 1 or 5 * len(chosen) <= budget

    @precondition(lambda self: self.taken["train"])
    @rule()
    def clear(self):
        self.bus.clear_consumed(list(TASKS))

    @invariant()
    def nothing_twice_nothing_invented(self):
        for task, rows in self.taken.items():
            assert len(rows) == len(set(rows)), f"{task} got a row twice"
            assert set(rows) <= self.added

    @invariant()
    def each_task_knows_what_it_has_not_consumed(self):
        for task, unconsumed in self.bus.open.items():
            assert set(unconsumed) == {r.row_id for r in self.bus.rows.values() if task not in r.consumed_by}

    @invariant()
    def nothing_lost(self):
        """Every added row is either still in the bus or was consumed by every task before clearing."""
        cleared = self.added - set(self.bus.rows)
        assert cleared <= set(self.taken["train"]) & set(self.taken["reward"])

    def teardown(self):
        # drain: every row still in the bus reaches every task exactly once
        reward_rows = self.bus.take("reward", TASKS["reward"], 10_000, partial=True)
        if reward_rows:
            self.bus.add_fields(reward_rows, {"reward": [1.0] * len(reward_rows)})
        self.taken["reward"].extend(reward_rows)
        self.taken["train"].extend(self.bus.take("train", TASKS["train"], 9_999, GroupSampler(GROUP),
                                                 partial=True))
        for task, rows in self.taken.items():
            assert sorted(rows) == sorted(self.added), f"{task} missed or repeated rows"


TestBusMachine = BusMachine.TestCase
TestBusMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_released_rows_go_back_to_the_task_only():
    bus = BusIndex(capacity=4)
    rows = bus.add_rows({"x": [1, 2]}, group_ids=[0, 0], num_tokens=[1, 1])
    assert bus.take("reward", ["x"], 2) == rows and bus.take("train", ["x"], 2) == rows
    bus.release("reward", rows[:1])  # the reward replica that held row 0 died before finishing it
    assert bus.take("reward", ["x"], 2, partial=True) == rows[:1]
    assert bus.take("train", ["x"], 1, partial=True) == []


def test_a_resumable_snapshot_hands_back_unfinished_work_and_retaken_tasks():
    """Resume: a group still being made goes; a task whose output is missing takes its row again; a
    task without an output keeps its mark unless its consumer restarts from older state (`retake`)."""
    bus = BusIndex(capacity=8)
    done = bus.add_rows({"x": [1, 2]}, group_ids=[0, 0], num_tokens=[1, 1])
    bus.add_rows({"x": [3]}, group_ids=[1], num_tokens=[1])  # group 1 was unfinished at the checkpoint
    bus.take("reward", ["x"], 2)
    bus.add_fields(done[:1], {"reward": [1.0]})  # row 1's reward died with the run
    bus.take("train", ["x"], 2)
    bus.take("critic_train", ["x"], 2)
    state = BusIndex.resumable(bus.snapshot(), drop_groups=[1], outputs={"reward": "reward"},
                               retake=frozenset({"critic_train"}))
    resumed = BusIndex.restore(state)
    assert sorted(resumed.rows) == done
    assert resumed.take("reward", ["x"], 2, partial=True) == done[1:]
    assert resumed.take("train", ["x"], 2, partial=True) == []
    assert resumed.take("critic_train", ["x"], 2, partial=True) == done
