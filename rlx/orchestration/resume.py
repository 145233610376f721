"""What an async checkpoint records beside the models (the bus and the prompt source), and how a
resumed run rebuilds them from it. Pure functions: testable without Ray."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from rlx.bus.core import BusIndex


class Snapshots(Protocol):
    def snapshot(self) -> dict[str, Any]: ...


class ResumeStates(Protocol):
    def resume_state(self) -> dict[str, object]: ...


def capture_run_state(bus: Snapshots, prompts: ResumeStates) -> dict[str, Any]:
    """The prompt source first, then the bus. A rollout puts (and flushes) a group's last row
    before it reports the group finished, so every group the prompt snapshot calls finished is
    whole in the later bus snapshot, and any group finished in between is still listed unfinished
    (`resume_plan` keeps it if whole, redoes it if not). The other order strands a group finished
    between the two: finished for the prompts, short of rows on the bus, never made again."""
    prompts_state = prompts.resume_state()
    return {"prompts": prompts_state, "bus": bus.snapshot()}


def resume_plan(run_state: Mapping[str, Any], group_size: int, task_outputs: Mapping[str, str],
                retake: frozenset[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(bus snapshot to restore, prompt-source state to resume) from `capture_run_state`'s record.

    Unfinished groups with fewer rows than `group_size` (or than their producer declared) are made again (their rows leave the bus),
    as are groups taken after the prompt snapshot;
    every other row returns, handed again to any task whose output (`task_outputs`) it lacks;
    `retake` tasks take every row again (their consumer restarts from older state)."""
    bus, prompts = run_state["bus"], run_state["prompts"]
    made, declared = bus.get("rows_per_group", {}), bus.get("group_rows", {})
    redo = [g for g in prompts["unfinished"] if made.get(g, 0) < declared.get(g, group_size)]
    # groups first handed out after the prompt snapshot: the resumed source hands them out again
    # from its position, so their rows leave the bus (else the group would be made twice)
    late = [g for g in made if g >= prompts["position"]]
    return (BusIndex.resumable(bus, redo + late, dict(task_outputs), retake=retake),
            {"position": prompts["position"], "unfinished": redo, "rolled_back": prompts.get("rolled_back", 0)})
