"""The data bus on Ray: values in the object store, the index in one async actor.

A `put` sends its columns to the bus actor, which stores them as one object (one `ray.put`) and
indexes references to it. The actor puts them itself because Ray makes the putting process an
object's owner (Ray 2.56 removed `_owner`): objects put by a producer would die with it, and a
consumer reading a dead replica's rows would fail. Owned by the long-lived bus actor, rows outlive
any producer. A `get` waits in the actor until its sampler is satisfied, then hands back
references that the consumer resolves in one `ray.get` (zero-copy within a node).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from rlx.bus.core import BusFull, BusIndex, BusTimeout
from rlx.bus.samplers import SamplerSpec, make_sampler


@ray.remote(num_cpus=0, max_concurrency=1000)
class BusActor:
    def __init__(self, capacity: int) -> None:
        self.index = BusIndex(capacity)
        self.changed = asyncio.Condition()
        self.wait_seconds: dict[str, float] = {}

    async def _wait_until(self, attempt, timeout: float | None, describe) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        async with self.changed:
            while True:
                result = attempt()
                if result:
                    return result
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if describe is None:
                        return None
                    raise BusTimeout(describe())
                try:
                    await asyncio.wait_for(self.changed.wait(), remaining)
                except asyncio.TimeoutError:
                    continue

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    @staticmethod
    def _store(values: dict[str, list]) -> dict[str, list]:
        """One object per call, owned by this actor; each row's field becomes (reference, position)."""
        count = len(next(iter(values.values()))) if values else 0
        ref = ray.put(values)
        return {field: [(ref, i) for i in range(count)] for field in values}

    async def add_rows(self, values: dict[str, list], group_ids: list[int], num_tokens: list[int],
                       timeout: float | None) -> list[int]:
        values = self._store(values)

        def attempt():
            try:
                return self.index.add_rows(values, group_ids, num_tokens)
            except BusFull:
                return None

        row_ids = await self._wait_until(
            attempt, timeout,
            lambda: f"put of {len(group_ids)} rows waited {timeout}s for room: bus holds "
                    f"{len(self.index.rows)} of {self.index.capacity} rows (consumers are behind)")
        await self._notify()
        return row_ids

    async def add_fields(self, row_ids: list[int], values: dict[str, list]) -> None:
        self.index.add_fields(row_ids, self._store(values))
        await self._notify()

    async def get(self, task: str, fields: list[str], batch_size: int, sampler: SamplerSpec | None,
                  timeout: float | None, partial: bool, raise_on_timeout: bool = True, consumer: str | None = None,
                  ) -> tuple[list[int], dict[str, list]]:
        chooser = make_sampler(sampler)
        started = time.monotonic()
        describe = (lambda: self.index.timeout_message(task, fields, batch_size, timeout)) if raise_on_timeout else None
        row_ids = await self._wait_until(
            lambda: self.index.take(task, fields, batch_size, chooser, partial, consumer), timeout, describe) or []
        self.wait_seconds[task] = self.wait_seconds.get(task, 0.0) + time.monotonic() - started
        await self._notify()
        return row_ids, self.index.values(row_ids, fields)

    async def release(self, task: str, row_ids: list[int]) -> None:
        self.index.release(task, row_ids)
        await self._notify()

    async def clear(self, row_ids: list[int]) -> None:
        self.index.clear(row_ids)
        await self._notify()

    async def clear_consumed(self, tasks: list[str]) -> list[int]:
        done = self.index.clear_consumed(tasks)
        await self._notify()
        return done

    async def release_held(self, consumer: str, task: str, done_field: str | None) -> int:
        released = self.index.release_held(consumer, task, done_field)
        await self._notify()
        return released

    async def abandon_incomplete_groups(self, group_ids: list[int], group_size: int) -> list[int]:
        dropped = self.index.abandon_incomplete_groups(group_ids, group_size)
        await self._notify()
        return dropped

    def count(self, name: str, amount: int) -> None:
        self.index.count(name, amount)

    def metrics(self) -> dict[str, float]:
        return {**self.index.metrics(), **{f"bus_wait_s:{k}": v for k, v in self.wait_seconds.items()}}

    def snapshot(self) -> dict[str, Any]:
        return self.index.snapshot()

    async def restore(self, state: dict[str, Any]) -> None:
        for row in state["rows"]:
            stored = self._store({f: [v] for f, v in row[3].items()}) if row[3] else {}
            row[3].clear()
            row[3].update({f: column[0] for f, column in stored.items()})
        self.index = BusIndex.restore(state)
        await self._notify()


class Bus:
    """Client handle: cheap to pickle, usable from any process in the Ray cluster."""

    def __init__(self, actor: ray.actor.ActorHandle) -> None:
        self.actor = actor
        self.consumer: str | None = None

    @classmethod
    def create(cls, capacity: int = 100_000, name: str | None = None) -> Bus:
        options = {"name": name, "lifetime": None} if name else {}
        return cls(BusActor.options(**options).remote(capacity))

    def put(self, values: dict[str, list], group_ids: list[int], num_tokens: list[int] | None = None,
            timeout: float | None = None) -> list[int]:
        """New rows. Blocks while the bus is full (back-pressure), up to `timeout` seconds."""
        tokens = num_tokens if num_tokens is not None else [0] * len(group_ids)
        try:
            return ray.get(self.actor.add_rows.remote(values, group_ids, tokens, timeout))
        except BusTimeout as exc:
            raise BusTimeout(str(getattr(exc, "cause", exc))) from None

    def put_fields(self, row_ids: list[int], values: dict[str, list]) -> None:
        ray.get(self.actor.add_fields.remote(row_ids, values))

    def get(self, task: str, fields: list[str], batch_size: int, timeout: float | None = None,
            sampler: SamplerSpec | None = None, partial: bool = False) -> tuple[list[int], dict[str, list]]:
        """Rows whose `fields` are all present and that `task` has not consumed; marks them consumed."""
        try:
            row_ids, refs = ray.get(self.actor.get.remote(task, fields, batch_size, sampler, timeout, partial,
                                                                  True, self.consumer))
        except BusTimeout as exc:  # Ray wraps it with the remote traceback; keep the message plain
            raise BusTimeout(str(getattr(exc, "cause", exc))) from None
        return self._resolve(row_ids, refs)

    def poll(self, task: str, fields: list[str], batch_size: int, timeout: float,
             sampler: SamplerSpec | None = None, partial: bool = False) -> tuple[list[int], dict[str, list]]:
        """Like `get`, but an empty result instead of an error when nothing is ready in time
        (for workers that poll: an exception per idle poll costs real CPU)."""
        row_ids, refs = ray.get(self.actor.get.remote(task, fields, batch_size, sampler, timeout, partial, False,
                                                              self.consumer))
        return self._resolve(row_ids, refs)

    @staticmethod
    def _resolve(row_ids: list[int], refs: dict[str, list]) -> tuple[list[int], dict[str, list]]:
        if not row_ids:
            return [], {}
        unique = list({ref for column in refs.values() for ref, _ in column})
        resolved = dict(zip(unique, ray.get(unique)))
        return row_ids, {f: [resolved[ref][f][i] for ref, i in column] for f, column in refs.items()}

    def release(self, task: str, row_ids: list[int]) -> None:
        ray.get(self.actor.release.remote(task, row_ids))

    def release_held(self, consumer: str, task: str, done_field: str | None) -> int:
        """Rows a dead replica took for `task` and never finished go back to `task`."""
        return ray.get(self.actor.release_held.remote(consumer, task, done_field))

    def abandon_incomplete_groups(self, group_ids: list[int], group_size: int) -> list[int]:
        """Drop the rows of groups a dead producer left unfinished; returns those groups."""
        return ray.get(self.actor.abandon_incomplete_groups.remote(group_ids, group_size))

    def for_consumer(self, consumer: str) -> Bus:
        """The same bus, with every row this client takes recorded as held by `consumer`."""
        bus = Bus(self.actor)
        bus.consumer = consumer
        return bus

    def clear(self, row_ids: list[int]) -> None:
        ray.get(self.actor.clear.remote(row_ids))

    def clear_consumed(self, tasks: list[str]) -> list[int]:
        return ray.get(self.actor.clear_consumed.remote(tasks))

    def count(self, name: str, amount: int) -> None:
        """Add to a shared counter (e.g. groups dropped by dynamic sampling); fire and forget."""
        self.actor.count.remote(name, amount)

    def metrics(self) -> dict[str, float]:
        return ray.get(self.actor.metrics.remote())

    def snapshot(self) -> dict[str, Any]:
        """The whole bus with values resolved: picklable into a checkpoint, independent of Ray."""
        state = ray.get(self.actor.snapshot.remote())
        refs = list({ref for row in state["rows"] for ref, _ in row[3].values()})
        resolved = dict(zip(refs, ray.get(refs)))
        for row in state["rows"]:
            row[3].update({f: resolved[ref][f][i] for f, (ref, i) in row[3].items()})
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Load a snapshot (from `snapshot`); the bus actor puts its values back into the object store."""
        ray.get(self.actor.restore.remote(state))
