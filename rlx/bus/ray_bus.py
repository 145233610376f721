"""The data bus on Ray: values in the object store (or inline when small), the index in one async actor.

A `put` sends its columns to the bus actor. Small ones (most RL fields: token ids, rewards, text)
stay in the actor and travel back inline with a `get`; large ones become one object per call
(one `ray.put`) that rows reference. The actor puts them itself because Ray makes the putting
process an object's owner (Ray 2.56 removed `_owner`): objects put by a producer would die with
it, and a consumer reading a dead replica's rows would fail. Owned by the long-lived bus actor,
rows outlive any producer. A `get` waits in the actor until its sampler is satisfied, then hands
back the values and references that the consumer resolves in one `ray.get` (zero-copy in a node).

Writes do not wait for a reply (the actor costs about a millisecond per call here, so a reply
per sample would cap a producer at a thousand rows a second): a client names its rows from blocks
of reserved ids and queues its writes; a sender thread sends whatever is queued as one batch
whenever the previous batch has landed. `flush()` confirms them and raises a failed one; every read flushes first, so a client
reads its own writes. A producer flushes before it reports work done, so a crash never reports a
row the bus did not get.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from typing import Any

import ray
import torch

from rlx.bus.columns import INLINE_BYTES, approx_nbytes, pack
from rlx.bus.core import BusFull, BusIndex, BusTimeout, check_columns
from rlx.bus.samplers import SamplerSpec, make_sampler
from rlx.bus.schema import FieldDeclaration, Schema


class Stored:
    """A row's field held in the object store: item `position` of the object `ref`. In a reply to
    a client, `ref` is the object's number in the reply's list of references instead (each
    reference is sent once: serializing one costs Ray about 0.1 ms)."""

    __slots__ = ("position", "ref")

    def __init__(self, ref: ray.ObjectRef | int, position: int) -> None:
        self.ref, self.position = ref, position

    def __reduce__(self):
        return Stored, (self.ref, self.position)


class _Reply:
    """Numbers the distinct object references of the entries it exports."""

    def __init__(self) -> None:
        self.slots: dict[ray.ObjectRef, int] = {}

    def entry(self, value: Any) -> Any:
        if isinstance(value, Stored):
            return Stored(self.slots.setdefault(value.ref, len(self.slots)), value.position)
        return value

    @property
    def refs(self) -> list[ray.ObjectRef]:
        return list(self.slots)


@ray.remote(num_cpus=0, max_concurrency=1000)
class BusActor:
    def __init__(self, capacity: int, schema: Schema | None = None) -> None:
        self.index = BusIndex(capacity, schema)
        self.changed = asyncio.Condition()
        self.wait_seconds: dict[str, float] = {}

    async def _wait_until(self, attempt, timeout: float | None, describe) -> Any:
        """`attempt()` until it returns something truthy. The first try runs before any await, so
        writes from one client apply in the order they were sent."""
        result = attempt()
        if result:
            return result
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
                except TimeoutError:
                    continue

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    @staticmethod
    def _store(values: dict[str, list]) -> dict[str, list]:
        """Small columns as they are; large ones as one object owned by this actor, each row's
        field a `Stored` reference into it."""
        if approx_nbytes(values) <= INLINE_BYTES:
            return values
        count = len(next(iter(values.values()))) if values else 0
        ref = ray.put(values)
        return {field: [Stored(ref, i) for i in range(count)] for field in values}

    def _store_one(self, values: dict[str, Any]) -> dict[str, Any]:
        """`_store` for one row's (or one group's) fields."""
        return {f: column[0] for f, column in self._store({f: [v] for f, v in values.items()}).items()} if values else {}

    def reserve(self, count: int) -> int:
        return self.index.reserve(count)

    async def _add_rows(self, values: dict[str, list], group_ids: list[int], num_tokens: list[int],
                        timeout: float | None, row_ids: list[int]) -> None:
        self.index.schema.check_rows(row_ids, values)
        values = self._store(values)

        def attempt():
            try:
                return self.index.add_rows(values, group_ids, num_tokens, row_ids)
            except BusFull:
                return None

        await self._wait_until(
            attempt, timeout,
            lambda: f"put of {len(group_ids)} rows waited {timeout}s for room: bus holds "
                    f"{len(self.index.rows)} of {self.index.capacity} rows (consumers are behind)")

    async def apply(self, writes: list[tuple[str, tuple]]) -> list[Exception]:
        """A client's writes, in order: ("rows", add_rows args), ("fields", (row_ids, values)),
        ("group", (group_id, values, rows)) or ("clear", (row_ids,)). One failing write does not stop
        the others; the failures come back."""
        failures = []
        for kind, args in writes:
            try:
                if kind == "rows":
                    await self._add_rows(*args)
                elif kind == "fields":
                    self.index.schema.check_fields(*args)
                    self.index.add_fields(args[0], self._store(args[1]))
                elif kind == "group":
                    self.index.schema.check_group(args[0], args[1])
                    self.index.add_group_fields(args[0], self._store_one(args[1]), args[2])
                else:
                    self.index.clear(*args)
            except Exception as exc:  # noqa: BLE001 - handed to the client, which raises it
                failures.append(exc)
        await self._notify()
        return failures

    async def get(self, task: str, fields: list[str], batch_size: int, sampler: SamplerSpec | None,
                  timeout: float | None, partial: bool, raise_on_timeout: bool = True, consumer: str | None = None,
                  ) -> tuple[list[int], dict[str, list]]:
        chooser = make_sampler(sampler)
        started = time.monotonic()
        describe = (lambda: self.index.timeout_message(task, fields, batch_size, timeout)) if raise_on_timeout else None
        row_ids, taken = await self._wait_until(
            lambda: self.index.take_values(task, fields, batch_size, chooser, partial, consumer), timeout,
            describe) or ([], {})
        self.wait_seconds[task] = self.wait_seconds.get(task, 0.0) + time.monotonic() - started
        reply = _Reply()
        values = {f: [reply.entry(v) for v in column] for f, column in taken.items()}
        await self._notify()
        return row_ids, reply.refs, values

    async def release(self, task: str, row_ids: list[int]) -> None:
        self.index.release(task, row_ids)
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

    def snapshot(self) -> tuple[list[ray.ObjectRef], dict[str, Any]]:
        state, reply = self.index.snapshot(), _Reply()
        for values in [row[3] for row in state["rows"]] + list(state["group_values"].values()):
            values.update({f: reply.entry(v) for f, v in values.items()})
        return reply.refs, state

    async def restore(self, state: dict[str, Any]) -> None:
        for values in [row[3] for row in state["rows"]] + list(state.get("group_values", {}).values()):
            stored = self._store_one(values)
            values.clear()
            values.update(stored)
        self.index = BusIndex.restore(state, self.index.schema)
        await self._notify()


class Bus:
    """Client handle: cheap to pickle (writes in flight stay with the process that sent them),
    usable from any process in the Ray cluster."""

    max_queued = 256  # writes queued behind the batch in flight before a write waits (back-pressure)
    reserve_block = 1024  # row ids reserved per round trip

    def __init__(self, actor: ray.actor.ActorHandle, consumer: str | None = None) -> None:
        self.actor = actor
        self.consumer = consumer
        self._ids: range = range(0)
        self._lock = threading.Lock()  # scoring threads share one client
        self._changed = threading.Condition(self._lock)
        self._queued: list[tuple[str, tuple]] = []  # writes not sent yet
        self._sending = False  # a batch is on its way to the bus
        self._failures: list[Exception] = []  # failed writes not yet raised by `flush`
        self._sender: threading.Thread | None = None

    def __reduce__(self):
        return Bus, (self.actor, self.consumer)

    @classmethod
    def create(cls, capacity: int = 100_000, name: str | None = None,
               check_schema: Iterable[FieldDeclaration] | None = None) -> Bus:
        """A new bus actor; `check_schema` as for `LocalBus` (the check runs in the bus actor)."""
        options = {"name": name, "lifetime": None} if name else {}
        return cls(BusActor.options(**options).remote(capacity, Schema(check_schema)))

    # -- writes ----------------------------------------------------------------------------------
    def _row_ids(self, count: int) -> list[int]:
        if len(self._ids) < count:
            block = max(count, self.reserve_block)
            first = ray.get(self.actor.reserve.remote(block))
            self._ids = range(first, first + block)
        ids, self._ids = list(self._ids[:count]), self._ids[count:]
        return ids

    def _send_forever(self) -> None:
        """The sender thread: whatever is queued goes as one batch; it waits on a plain future,
        never inside a Ray call, so a process that shuts Ray down is never caught mid-call."""
        while True:
            with self._changed:
                while not self._queued:
                    self._changed.wait()
                writes, self._queued, self._sending = self._queued, [], True
            try:
                failures = self.actor.apply.remote(writes).future().result()
            except Exception as exc:  # noqa: BLE001 - the bus itself is gone
                failures = [exc]
            with self._changed:
                self._failures.extend(failures)
                self._sending = False
                self._changed.notify_all()

    def _write(self, kind: str, args: tuple) -> None:
        with self._changed:
            while len(self._queued) >= self.max_queued:  # back-pressure
                self._changed.wait()
            self._queued.append((kind, args))
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_forever, name="rlx-bus-writes", daemon=True)
                self._sender.start()
            self._changed.notify_all()

    def flush(self) -> None:
        """Wait until every write this client made is applied; raise the first that failed."""
        with self._changed:
            while self._queued or self._sending:
                self._changed.wait()
            failures, self._failures = self._failures, []
        if failures:
            first = failures[0]
            more = f" ({len(failures) - 1} more writes failed too)" if len(failures) > 1 else ""
            if isinstance(first, (BusTimeout, KeyError, ValueError)):
                raise type(first)(f"{first}{more}")
            raise first

    def put(self, values: dict[str, list], group_ids: list[int], num_tokens: list[int] | None = None,
            timeout: float | None = None) -> list[int]:
        """New rows; returns their ids at once. While the bus is full the write waits in the bus,
        up to `timeout` seconds, and this client stops once `max_queued` writes wait behind it."""
        tokens = num_tokens if num_tokens is not None else [0] * len(group_ids)
        check_columns(values, len(group_ids))
        if len(tokens) != len(group_ids):
            raise ValueError(f"num_tokens has {len(tokens)} entries for {len(group_ids)} rows")
        with self._lock:
            row_ids = self._row_ids(len(group_ids))
        self._write("rows", (pack(values), group_ids, tokens, timeout, row_ids))
        return row_ids

    def put_fields(self, row_ids: list[int], values: dict[str, list]) -> None:
        """Add fields to existing rows."""
        check_columns(values, len(row_ids))
        self._write("fields", (row_ids, pack(values)))

    def put_group(self, group_id: int, values: dict[str, Any], rows: int) -> None:
        """Fields shared by the group's `rows` rows, stored once (put before its rows)."""
        self._write("group", (group_id, values, rows))

    def clear(self, row_ids: list[int]) -> None:
        """Drop rows (applied in order with this client's other writes)."""
        self._write("clear", (row_ids,))

    # -- reads -----------------------------------------------------------------------------------
    def get(self, task: str, fields: list[str], batch_size: int, timeout: float | None = None,
            sampler: SamplerSpec | None = None, partial: bool = False) -> tuple[list[int], dict[str, list]]:
        """Rows whose `fields` are all present and that `task` has not consumed; marks them consumed."""
        self.flush()
        try:
            row_ids, refs, stored = ray.get(self.actor.get.remote(task, fields, batch_size, sampler, timeout,
                                                                  partial, True, self.consumer))
        except BusTimeout as exc:  # Ray wraps it with the remote traceback; keep the message plain
            raise BusTimeout(str(getattr(exc, "cause", exc))) from None
        return row_ids, _resolve(refs, stored)

    def poll(self, task: str, fields: list[str], batch_size: int, timeout: float,
             sampler: SamplerSpec | None = None, partial: bool = False) -> tuple[list[int], dict[str, list]]:
        """Like `get`, but an empty result instead of an error when nothing is ready in time
        (for workers that poll: an exception per idle poll costs real CPU)."""
        self.flush()
        row_ids, refs, stored = ray.get(self.actor.get.remote(task, fields, batch_size, sampler, timeout, partial,
                                                              False, self.consumer))
        return (row_ids, _resolve(refs, stored)) if row_ids else ([], {})

    # -- housekeeping ----------------------------------------------------------------------------
    def release(self, task: str, row_ids: list[int]) -> None:
        self.flush()
        ray.get(self.actor.release.remote(task, row_ids))

    def release_held(self, consumer: str, task: str, done_field: str | None) -> int:
        """Rows a dead replica took for `task` and never finished go back to `task`."""
        self.flush()
        return ray.get(self.actor.release_held.remote(consumer, task, done_field))

    def abandon_incomplete_groups(self, group_ids: list[int], group_size: int) -> list[int]:
        """Drop the rows of groups a dead producer left unfinished; returns those groups."""
        self.flush()
        return ray.get(self.actor.abandon_incomplete_groups.remote(group_ids, group_size))

    def for_consumer(self, consumer: str) -> Bus:
        """The same bus, with every row this client takes recorded as held by `consumer`."""
        return Bus(self.actor, consumer)

    def clear_consumed(self, tasks: list[str]) -> list[int]:
        self.flush()
        return ray.get(self.actor.clear_consumed.remote(tasks))

    def count(self, name: str, amount: int) -> None:
        """Add to a shared counter (e.g. groups dropped by dynamic sampling); fire and forget."""
        self.actor.count.remote(name, amount)

    def metrics(self) -> dict[str, float]:
        self.flush()
        return ray.get(self.actor.metrics.remote())

    def snapshot(self) -> dict[str, Any]:
        """The whole bus with values resolved: picklable into a checkpoint, independent of Ray."""
        self.flush()
        refs, state = ray.get(self.actor.snapshot.remote())
        objects = ray.get(refs)
        for values in [row[3] for row in state["rows"]] + list(state["group_values"].values()):
            values.update({f: _own(objects[v.ref][f][v.position]) for f, v in values.items() if isinstance(v, Stored)})
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Load a snapshot (from `snapshot`); the bus actor puts its values back into the object store."""
        self.flush()
        ray.get(self.actor.restore.remote(state))


def _own(value: Any) -> Any:
    """A row of a packed column is a view into the whole put's buffer: copy it before pickling."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _resolve(refs: list[ray.ObjectRef], stored: dict[str, list]) -> dict[str, list]:
    """Values as the bus handed them out: inline ones as they are, `Stored` ones fetched in one `ray.get`."""
    if not refs:
        return stored
    objects = ray.get(refs)
    return {field: [objects[e.ref][field][e.position] if isinstance(e, Stored) else e for e in column]
            for field, column in stored.items()}
