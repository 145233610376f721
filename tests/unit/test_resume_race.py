"""The Actor's checkpoint snapshots the prompt source and the bus one after the other; a group whose
last row lands between the two must come back whole or be made again, never stranded."""

from __future__ import annotations

import pytest

from rlx.bus.core import BusIndex
from rlx.data.rows import PromptRow
from rlx.data.stream import PromptStream
from rlx.orchestration.prompt_source import PromptSource
from rlx.orchestration.resume import capture_run_state, resume_plan
from rlx.orchestration.staleness import StalenessGate

N = 2  # rows per group
OUTPUTS, RETAKE = {"reward": "reward"}, frozenset({"critic_train"})


def land(bus: BusIndex, group: int) -> None:
    bus.add_rows({"response_ids": [[group]]}, [group], [1])


class Window:
    """Both sides as a run has them: group 0 complete and reported, group 1 one row short. What
    happens while the checkpoint runs is injected at the instant between its two snapshots."""

    def __init__(self) -> None:
        self.source = PromptSource(PromptStream([PromptRow(f"q{i}", "a") for i in range(4)], seed=0),
                                   StalenessGate(max_staleness=1, groups_per_step=2))
        self.bus = BusIndex()
        assert [g for g, _ in self.source.take(2, "rollout-1", version=0)] == [0, 1]
        land(self.bus, 0)
        land(self.bus, 0)
        self.source.finished("rollout-1", [0])
        land(self.bus, 1)
        self.between: list = []  # what happens after the first snapshot, before the second

    def last_row(self) -> None:
        land(self.bus, 1)

    def new_group(self) -> None:
        """A rollout takes the next group and lands all its rows while the checkpoint runs."""
        [(group, _)] = self.source.take(1, "rollout-1", version=0)
        land(self.bus, group)
        land(self.bus, group)

    def finish(self) -> None:
        self.source.finished("rollout-1", [1])

    def snapshot(self) -> dict:  # the bus side
        return self._then(self.bus.snapshot())

    def resume_state(self) -> dict:  # the prompt side
        return self._then(self.source.resume_state())

    def _then(self, taken: dict) -> dict:
        for event in self.between:
            event()
        self.between = []
        return taken


def stranded(state: dict) -> list[int]:
    """Restore as `Controller._restore` does; the groups neither whole on the bus nor handed out again."""
    bus_state, prompts_state = resume_plan(state, N, OUTPUTS, RETAKE)
    bus = BusIndex.restore(bus_state)
    source = PromptSource(PromptStream([PromptRow(f"q{i}", "a") for i in range(4)], seed=0), StalenessGate(1, 2))
    source.resume(prompts_state)
    redo = {g for g, _ in source.retry}
    rows = [r.group_id for r in bus.rows.values()]
    assert not any(g in rows for g in redo)  # a group made again starts from no rows
    return [g for g in range(prompts_state["position"]) if g not in redo and rows.count(g) < N]


@pytest.mark.parametrize("between, after", [
    (["last_row", "finish"], []),  # the group completes in the window
    (["last_row"], ["finish"]),  # its last row lands in the window, the report comes later
    ([], ["last_row", "finish"]),  # nothing happens in the window
])
def test_prompts_first_then_bus_never_strands_a_group(between, after):
    window = Window()
    window.between = [getattr(window, name) for name in between]
    state = capture_run_state(bus=window, prompts=window)
    for name in after:
        getattr(window, name)()
    assert stranded(state) == []


def test_a_group_taken_between_the_snapshots_is_made_once_after_resume():
    window = Window()
    window.between = [window.new_group]
    state = capture_run_state(bus=window, prompts=window)
    bus_state, prompts_state = resume_plan(state, N, OUTPUTS, RETAKE)
    assert 2 not in [row[1] for row in bus_state["rows"]]  # its rows leave the bus ...
    assert prompts_state["position"] == 2  # ... and the resumed source hands group 2 out again
    assert stranded(state) == []


def test_the_old_order_strands_the_group_that_completes_in_the_window():
    """Bus first, then prompts (the order this replaced): group 1 is finished for the prompt
    source, one row short on the bus, and no one makes it again."""
    window = Window()
    window.between = [window.last_row, window.finish]
    state = {"bus": window.snapshot(), "prompts": window.resume_state()}
    assert stranded(state) == [1]
