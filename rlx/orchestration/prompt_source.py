"""The one place prompt groups are handed out: admission control, and nothing lost when a rollout dies.

Every Rollout replica asks the same PromptSource for groups (in async mode it lives in a Ray actor,
so N replicas share one data order and one staleness budget). It remembers which groups each
replica holds until all their samples are on the bus; if the replica dies first, those groups go
back to the front of the queue and are handed out again, so a prompt is never lost or trained twice.
"""

from __future__ import annotations

from collections import Counter, deque

import ray

from rlx.data.rows import PromptRow
from rlx.data.stream import PromptStream
from rlx.orchestration.staleness import StalenessGate

Issued = tuple[int, PromptRow]  # (group id = position in the stream, row)


class PromptSource:
    def __init__(self, stream: PromptStream, gate: StalenessGate) -> None:
        self.stream, self.gate = stream, gate
        self.retry: deque[Issued] = deque()
        self.held: dict[str, dict[int, PromptRow]] = {}  # replica -> groups it has not finished
        self.stats: Counter = Counter()

    @property
    def position(self) -> int:
        return self.stream.position

    def take(self, count: int, consumer: str, version: int | None = None, dropped: int = 0) -> list[Issued]:
        """Up to `count` groups for `consumer`: returned groups first, then new ones as far as the
        staleness gate allows at trainer `version` (None: no gate, colocated mode).

        `dropped` groups (dynamic sampling) and groups whose training was rolled back give their
        place in the budget to new ones."""
        out = [self.retry.popleft() for _ in range(min(count, len(self.retry)))]
        fresh = count - len(out)
        if version is not None:
            started = self.stream.position - dropped - self.stats["groups_rolled_back"]
            fresh = min(fresh, self.gate.groups_allowed(started, version))
        out += self.stream.take(max(0, fresh))
        self.held.setdefault(consumer, {}).update(out)
        self.stats["groups_issued"] += len(out)
        return out

    def finished(self, consumer: str, group_ids: list[int]) -> None:
        """All samples of these groups are on the bus."""
        held = self.held.get(consumer, {})
        for group_id in group_ids:
            held.pop(group_id, None)

    def held_by(self, consumer: str) -> list[int]:
        return sorted(self.held.get(consumer, {}))

    def rollback(self, steps: int) -> None:
        """The Actor was restored `steps` steps back: the groups those steps trained on are gone
        with its lost updates, so as many new groups may start without breaking the gate."""
        self.stats["groups_rolled_back"] += steps * self.gate.groups_per_step

    def requeue(self, consumer: str, group_ids: list[int]) -> None:
        """A replica died: of its groups, `group_ids` are handed out again (first); the others were
        complete after all (the 'finished' note died with the replica)."""
        held = self.held.pop(consumer, {})
        lost = [(g, held[g]) for g in sorted(group_ids) if g in held]
        self.retry.extendleft(reversed(lost))
        self.stats["groups_requeued"] += len(lost)

    def resume_state(self) -> dict[str, object]:
        """What a restarted run needs: the position, and every group handed out but not finished."""
        unfinished = sorted({g for groups in self.held.values() for g in groups} | {g for g, _ in self.retry})
        return {"position": self.stream.position, "unfinished": unfinished,
                "rolled_back": self.stats["groups_rolled_back"]}

    def resume(self, state: dict) -> None:
        """Continue from `resume_state()`: unfinished groups are handed out again, first."""
        self.stream.position = state["position"]
        self.stats["groups_rolled_back"] = state.get("rolled_back", 0)
        self.retry = deque((g, self.stream.row_at(g)) for g in state["unfinished"])
        self.held = {}

    def state(self) -> dict[str, int]:
        held = sum(len(groups) for groups in self.held.values())
        return {"position": self.stream.position, "groups_held": held, "groups_waiting_retry": len(self.retry),
                **self.stats}


RemotePromptSource = ray.remote(num_cpus=0)(PromptSource)


class PromptSourceClient:
    """A PromptSource in a Ray actor, with the local class's call signatures."""

    def __init__(self, actor: ray.actor.ActorHandle) -> None:
        self.actor = actor

    def take(self, count: int, consumer: str, version: int | None = None, dropped: int = 0) -> list[Issued]:
        return ray.get(self.actor.take.remote(count, consumer, version, dropped))

    def finished(self, consumer: str, group_ids: list[int]) -> None:
        self.actor.finished.remote(consumer, group_ids)  # ordered after this caller's earlier calls

    def held_by(self, consumer: str) -> list[int]:
        return ray.get(self.actor.held_by.remote(consumer))

    def requeue(self, consumer: str, group_ids: list[int]) -> None:
        ray.get(self.actor.requeue.remote(consumer, group_ids))

    def rollback(self, steps: int) -> None:
        ray.get(self.actor.rollback.remote(steps))

    def state(self) -> dict[str, int]:
        return ray.get(self.actor.state.remote())

    def resume_state(self) -> dict[str, object]:
        return ray.get(self.actor.resume_state.remote())

    def resume(self, state: dict) -> None:
        ray.get(self.actor.resume.remote(state))
