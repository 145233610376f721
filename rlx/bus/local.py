"""An in-process bus with the same API as the Ray bus: for colocated mode and for tests.

Values stay in this process; a condition variable makes `get` wait for producers on other threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from rlx.bus.core import BusFull, BusIndex, BusTimeout
from rlx.bus.samplers import SamplerSpec, make_sampler
from rlx.bus.schema import FieldDeclaration, Schema


class LocalBus:
    def __init__(self, capacity: int = 100_000, consumer: str | None = None,
                 check_schema: Iterable[FieldDeclaration] | None = None) -> None:
        """`check_schema`: the field declarations (`rlx.orchestration.plan.FIELDS`) every put is
        checked against (`rlx.bus.schema`); None, the default: no check."""
        self.index = BusIndex(capacity, Schema(check_schema))
        self.consumer = consumer
        self.changed = threading.Condition()
        self.wait_seconds: dict[str, float] = {}

    def _wait_until(self, attempt: Callable[[], Any], timeout: float | None,
                    describe: Callable[[], str] | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while True:
                result = attempt()
                if result:
                    self.changed.notify_all()
                    return result
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if describe is None:
                        return None
                    raise BusTimeout(describe())
                self.changed.wait(remaining)

    def put(self, values: dict[str, list], group_ids: list[int], num_tokens: list[int] | None = None,
            timeout: float | None = None) -> list[int]:
        tokens = num_tokens if num_tokens is not None else [0] * len(group_ids)
        with self.changed:  # named first, as the Ray bus's clients do, so the schema check sees the ids
            first = self.index.reserve(len(group_ids))
            row_ids = list(range(first, first + len(group_ids)))
            self.index.schema.check_rows(row_ids, values)

        def attempt():
            try:
                return self.index.add_rows(values, group_ids, tokens, row_ids)
            except BusFull:
                return None

        return self._wait_until(attempt, timeout, lambda: f"put of {len(group_ids)} rows waited {timeout}s for "
                                f"room: bus holds {len(self.index.rows)} of {self.index.capacity} rows")

    def flush(self) -> None:
        """Writes apply at once here; present for the Ray bus's API."""

    def put_group(self, group_id: int, values: dict[str, Any], rows: int) -> None:
        """Fields shared by the group's `rows` rows, stored once (put before its rows)."""
        with self.changed:
            self.index.schema.check_group(group_id, values)
            self.index.add_group_fields(group_id, values, rows)
            self.changed.notify_all()

    def put_fields(self, row_ids: list[int], values: dict[str, list]) -> None:
        with self.changed:
            self.index.schema.check_fields(row_ids, values)
            self.index.add_fields(row_ids, values)
            self.changed.notify_all()

    def get(self, task: str, fields: list[str], batch_size: int, timeout: float | None = None,
            sampler: SamplerSpec | None = None, partial: bool = False) -> tuple[list[int], dict[str, list]]:
        chooser, started = make_sampler(sampler), time.monotonic()
        taken = self._wait_until(lambda: self.index.take_values(task, fields, batch_size, chooser, partial,
                                                                self.consumer), timeout,
                                 lambda: self.index.timeout_message(task, fields, batch_size, timeout))
        with self.changed:
            self.wait_seconds[task] = self.wait_seconds.get(task, 0.0) + time.monotonic() - started
        return taken

    def poll(self, task: str, fields: list[str], batch_size: int, timeout: float,
             sampler: SamplerSpec | None = None, partial: bool = False) -> tuple[list[int], dict[str, list]]:
        """Like `get`, but an empty result instead of an error when nothing is ready in time."""
        chooser = make_sampler(sampler)
        return self._wait_until(lambda: self.index.take_values(task, fields, batch_size, chooser, partial,
                                                               self.consumer), timeout, None) or ([], {})

    def release(self, task: str, row_ids: list[int]) -> None:
        with self.changed:
            self.index.release(task, row_ids)
            self.changed.notify_all()

    def clear(self, row_ids: list[int]) -> None:
        with self.changed:
            self.index.clear(row_ids)
            self.changed.notify_all()

    def clear_consumed(self, tasks: list[str]) -> list[int]:
        with self.changed:
            done = self.index.clear_consumed(tasks)
            self.changed.notify_all()
            return done

    def for_consumer(self, consumer: str) -> LocalBus:
        """The same bus (shared index and lock), taking rows as `consumer`."""
        view = LocalBus.__new__(LocalBus)
        view.__dict__.update(self.__dict__)
        view.consumer = consumer
        return view

    def release_held(self, consumer: str, task: str, done_field: str | None) -> int:
        with self.changed:
            released = self.index.release_held(consumer, task, done_field)
            self.changed.notify_all()
            return released

    def abandon_incomplete_groups(self, group_ids: list[int], group_size: int) -> list[int]:
        with self.changed:
            dropped = self.index.abandon_incomplete_groups(group_ids, group_size)
            self.changed.notify_all()
            return dropped

    def count(self, name: str, amount: int) -> None:
        with self.changed:
            self.index.count(name, amount)

    def metrics(self) -> dict[str, float]:
        with self.changed:
            return {**self.index.metrics(), **{f"bus_wait_s:{k}": v for k, v in self.wait_seconds.items()}}
