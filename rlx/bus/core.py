"""The bus index: which rows exist, which fields each has, and which tasks consumed them.

Pure Python and synchronous, so its rules are testable without Ray. Field values are opaque to
the index: the Ray-backed bus stores object-store references here, an in-process bus the values.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rlx.bus.samplers import Candidate, Sampler, SequentialSampler
from rlx.bus.schema import Schema


class BusFull(Exception):
    """No room for new rows; the producer should wait (back-pressure)."""


class BusTimeout(TimeoutError):
    """A bus wait ran out; the message names the task, the missing fields and how many rows were ready."""


@dataclass
class Row:
    row_id: int
    group_id: int
    num_tokens: int
    values: dict[str, Any] = field(default_factory=dict)
    consumed_by: set[str] = field(default_factory=set)
    held_by: dict[str, str] = field(default_factory=dict)  # task -> the replica that took the row for it
    created_at: float = field(default_factory=time.monotonic)


class BusIndex:
    def __init__(self, capacity: int = 100_000, schema: Schema | None = None) -> None:
        """`schema` checks puts (`Schema.check_*`, called by the bus before it stores the values:
        the Ray bus stores large ones as object references); default: no check."""
        if capacity < 1:
            raise ValueError("bus capacity must be >= 1")
        self.capacity = capacity
        self.schema = schema or Schema(None)
        self.rows: dict[int, Row] = {}
        self.next_row_id = 0
        self.stats: Counter = Counter()
        self.rows_per_group: Counter = Counter()  # rows ever added, per group
        self.live_per_group: Counter = Counter()  # rows on the bus now, per group
        # fields stored once per group and read by each of its rows (scope "group": e.g. media inputs)
        self.group_values: dict[int, dict[str, Any]] = {}
        self.group_rows: dict[int, int] = {}  # rows a group will have, where its producer declared them
        # per task seen so far: the rows it has not consumed, so a take never scans consumed rows
        self.open: dict[str, dict[int, None]] = {}

    # -- writing ---------------------------------------------------------------------------------
    def reserve(self, count: int) -> int:
        """Set aside `count` row ids for a client that names its rows itself (so its puts need no
        reply); returns the first."""
        first = self.next_row_id
        self.next_row_id += count
        return first

    def add_rows(self, values: dict[str, list[Any]], group_ids: list[int], num_tokens: list[int],
                 row_ids: list[int] | None = None) -> list[int]:
        """New rows with their first fields, under fresh ids or under `row_ids` from `reserve`;
        raises BusFull if they do not fit."""
        count = len(group_ids)
        check_columns(values, count)
        if len(num_tokens) != count:
            raise ValueError(f"num_tokens has {len(num_tokens)} entries for {count} rows")
        if len(self.rows) + count > self.capacity:
            raise BusFull(f"bus holds {len(self.rows)} of {self.capacity} rows; {count} more do not fit")
        if row_ids is None:
            row_ids = list(range(self.reserve(count), self.next_row_id))
        elif len(row_ids) != count or any(r in self.rows or not 0 <= r < self.next_row_id for r in row_ids):
            raise ValueError(f"row ids {row_ids[:5]}... were not reserved, are in use, or are not one per row")
        for i, row_id in enumerate(row_ids):
            self.rows[row_id] = Row(row_id, group_ids[i], num_tokens[i], {k: v[i] for k, v in values.items()})
            self.rows_per_group[group_ids[i]] += 1
            self.live_per_group[group_ids[i]] += 1
            for unconsumed in self.open.values():
                unconsumed[row_id] = None
        self.stats["rows_added"] += count
        return row_ids

    def add_fields(self, row_ids: list[int], values: dict[str, list[Any]]) -> None:
        """Add (or overwrite) fields of existing rows. Rows cleared meanwhile (their group was given
        up after a producer died) are skipped and counted: the late result has nowhere to go."""
        check_columns(values, len(row_ids))
        if any(r >= self.next_row_id or r < 0 for r in row_ids):
            raise KeyError(f"rows {[r for r in row_ids if r >= self.next_row_id or r < 0][:5]} were never added")
        for i, row_id in enumerate(row_ids):
            if row_id in self.rows:
                self.rows[row_id].values.update({k: v[i] for k, v in values.items()})
            else:
                self.stats["fields_for_cleared_rows"] += 1

    def add_group_fields(self, group_id: int, values: dict[str, Any], rows: int) -> None:
        """Fields shared by the group's `rows` rows, stored once: put them before the group's rows
        (a row is ready for a task only once its group's fields are here too). They leave with the
        last of those rows, or when the group is abandoned. `rows` also tells group samplers when
        the group is whole: a producer whose groups vary in size raises it before adding the rows
        beyond it (`values` may be empty)."""
        self.group_values.setdefault(group_id, {}).update(values)
        self.group_rows[group_id] = rows

    def _has(self, row: Row, field_name: str) -> bool:
        return field_name in row.values or field_name in self.group_values.get(row.group_id, ())

    def _value(self, row: Row, field_name: str) -> Any:
        return row.values[field_name] if field_name in row.values else self.group_values[row.group_id][field_name]

    # -- reading ---------------------------------------------------------------------------------
    def _unconsumed(self, task: str) -> dict[int, None]:
        if task not in self.open:
            self.open[task] = {r.row_id: None for r in self.rows.values() if task not in r.consumed_by}
        return self.open[task]

    def ready(self, task: str, fields: list[str]) -> list[Candidate]:
        """Rows that have every field in `fields` and that `task` has not consumed, oldest first."""
        ready = [self.rows[r] for r in self._unconsumed(task) if all(self._has(self.rows[r], f) for f in fields)]
        return [Candidate(r.row_id, r.group_id, r.num_tokens, self.group_rows.get(r.group_id))
                for r in sorted(ready, key=lambda r: r.created_at)]

    def take(
        self, task: str, fields: list[str], batch_size: int, sampler: Sampler | None = None, partial: bool = False,
        consumer: str | None = None,
    ) -> list[int]:
        """Pick rows with the sampler and mark them consumed by `task`; [] when none qualify yet.

        `consumer` (a replica id) is remembered, so the rows can go back if that replica dies."""
        chosen = (sampler or SequentialSampler()).select(self.ready(task, fields), batch_size, partial)
        unconsumed = self._unconsumed(task)
        for row_id in chosen:
            self.rows[row_id].consumed_by.add(task)
            del unconsumed[row_id]
            if consumer is not None:
                self.rows[row_id].held_by[task] = consumer
        self.stats[f"taken:{task}"] += len(chosen)
        return chosen

    def take_values(self, task: str, fields: list[str], batch_size: int, sampler: Sampler | None = None,
                    partial: bool = False, consumer: str | None = None) -> tuple[list[int], dict[str, list[Any]]] | None:
        """`take`, and the taken rows' values read in the same breath: once taken, a row may be
        cleared by another task's `clear_consumed` at the next chance. None when none qualify."""
        row_ids = self.take(task, fields, batch_size, sampler, partial, consumer)
        return (row_ids, self.values(row_ids, fields)) if row_ids else None

    def values(self, row_ids: list[int], fields: list[str]) -> dict[str, list[Any]]:
        return {f: [self._value(self.rows[r], f) for r in row_ids] for f in fields}

    def release(self, task: str, row_ids: list[int]) -> None:
        """Give rows back to `task` (a consumer died before finishing them)."""
        for row_id in row_ids:
            if row_id in self.rows:
                self._give_back(task, self.rows[row_id])

    def _give_back(self, task: str, row: Row) -> None:
        row.consumed_by.discard(task)
        self._unconsumed(task)[row.row_id] = None

    def release_held(self, consumer: str, task: str, done_field: str | None) -> int:
        """A replica died: give `task` back the rows it took but did not finish (still lacking
        `done_field`, its output; None: every row it still holds, for a task that clears the rows
        it finishes). Returns how many rows went back."""
        released = 0
        for row in self.rows.values():
            if row.held_by.get(task) == consumer and (done_field is None or done_field not in row.values):
                self._give_back(task, row)
                del row.held_by[task]
                released += 1
        self.stats[f"released:{task}"] += released
        return released

    def abandon_incomplete_groups(self, group_ids: list[int], group_size: int) -> list[int]:
        """A producer died: drop the rows of those of `group_ids` that never got all their rows
        (`group_size`, or as declared): a partial group would bias group statistics. Returns the
        groups dropped."""
        incomplete = {g for g in group_ids if self.rows_per_group[g] < self.group_rows.get(g, group_size)}
        rows = [r.row_id for r in self.rows.values() if r.group_id in incomplete]
        self.clear(rows)
        for group in incomplete:
            self._drop_group_fields(group)
            del self.rows_per_group[group]  # its producer makes it again, from nothing
        self.stats["rows_of_abandoned_groups"] += len(rows)
        return sorted(incomplete)

    def missing_fields(self, task: str, fields: list[str]) -> dict[str, int]:
        """For a timeout message: per field, how many unconsumed rows still lack it."""
        pending = [r for r in self.rows.values() if task not in r.consumed_by]
        missing = {f: sum(not self._has(r, f) for r in pending) for f in fields}
        return {f: count for f, count in missing.items() if count}

    def timeout_message(self, task: str, fields: list[str], batch_size: int, waited: float | None) -> str:
        ready = len(self.ready(task, fields))
        return (f"task {task!r} waited {waited}s for {batch_size} rows with fields {fields}: {ready} ready; "
                f"unconsumed rows still missing each field: {self.missing_fields(task, fields)}")

    # -- housekeeping ----------------------------------------------------------------------------
    def clear(self, row_ids: list[int]) -> list[Any]:
        """Drop rows (and a group's shared fields with its last row); returns their values so the
        caller can free the storage behind them."""
        dropped = []
        self.schema.forget(row_ids)
        for row_id in row_ids:
            if (row := self.rows.pop(row_id, None)) is None:
                continue
            dropped.extend(row.values.values())
            group = row.group_id
            self.live_per_group[group] -= 1
            if self.live_per_group[group] <= 0:
                del self.live_per_group[group]
                if self.rows_per_group[group] >= self.group_rows.get(group, 0):  # none still to come
                    dropped.extend(self._drop_group_fields(group))
        for unconsumed in self.open.values():
            for row_id in row_ids:
                unconsumed.pop(row_id, None)
        self.stats["rows_cleared"] += len(row_ids)
        return dropped

    def _drop_group_fields(self, group_id: int) -> list[Any]:
        self.group_rows.pop(group_id, None)
        return list(self.group_values.pop(group_id, {}).values())

    def clear_consumed(self, tasks: list[str]) -> list[int]:
        """Drop rows every task in `tasks` has consumed; returns their ids."""
        done = [r.row_id for r in self.rows.values() if set(tasks) <= r.consumed_by]
        self.clear(done)
        return done

    def count(self, name: str, amount: int) -> None:
        """Add to a named counter that roles share through the bus (reported as `bus_<name>`)."""
        self.stats[name] += amount

    def metrics(self) -> dict[str, float]:
        now = time.monotonic()
        ages = [now - r.created_at for r in self.rows.values()]
        return {
            "bus_rows": float(len(self.rows)),
            "bus_capacity": float(self.capacity),
            "bus_oldest_row_age_s": max(ages, default=0.0),
            **{f"bus_{k}": float(v) for k, v in self.stats.items()},
            # rows each task has yet to take, made or still being made: the bus's back-pressure
            **{f"bus_waiting:{task}": float(len(rows)) for task, rows in self.open.items()},
        }

    def snapshot(self) -> dict[str, Any]:
        """Everything needed to rebuild the index (values included, as stored)."""
        return {
            "capacity": self.capacity,
            "next_row_id": self.next_row_id,
            "rows_per_group": dict(self.rows_per_group),
            "group_values": {g: dict(v) for g, v in self.group_values.items()},
            "group_rows": dict(self.group_rows),
            "rows": [(r.row_id, r.group_id, r.num_tokens, dict(r.values), sorted(r.consumed_by)) for r in self.rows.values()],
        }

    @staticmethod
    def resumable(state: dict[str, Any], drop_groups: list[int], outputs: dict[str, str],
                  retake: frozenset[str] = frozenset()) -> dict[str, Any]:
        """A snapshot taken while consumers were working, made safe to restore into a new run:
        rows of `drop_groups` go (their producer will make them again), and a task's consumption
        mark stays only if its output field (`outputs[task]`) was written; otherwise the row is
        handed to that task again. Tasks without an output field keep their marks, except those in
        `retake`, whose consumer restarts from state older than the snapshot and takes every row
        still on the bus again."""
        dropped = set(drop_groups)
        counts = {g: c for g, c in state.get("rows_per_group", {}).items() if g not in dropped}
        rows, kept_groups = [], set()
        for row_id, group_id, num_tokens, values, consumed in state["rows"]:
            if group_id in dropped:
                continue
            kept_groups.add(group_id)
            kept = [t for t in consumed if t not in retake and (t not in outputs or outputs[t] in values)]
            rows.append((row_id, group_id, num_tokens, values, kept))
        group_values = {g: v for g, v in state.get("group_values", {}).items() if g in kept_groups}
        group_rows = {g: v for g, v in state.get("group_rows", {}).items() if g in kept_groups}
        return {**state, "rows": rows, "rows_per_group": counts, "group_values": group_values, "group_rows": group_rows}

    @classmethod
    def restore(cls, state: dict[str, Any], schema: Schema | None = None) -> BusIndex:
        index = cls(state["capacity"], schema)
        index.schema.reset()
        index.next_row_id = state["next_row_id"]
        index.rows_per_group.update(state.get("rows_per_group", {}))
        index.group_values = {int(g): dict(v) for g, v in state.get("group_values", {}).items()}
        index.group_rows = {int(g): int(v) for g, v in state.get("group_rows", {}).items()}
        for row_id, group_id, num_tokens, values, consumed in state["rows"]:
            index.rows[row_id] = Row(row_id, group_id, num_tokens, values, set(consumed))
            index.live_per_group[group_id] += 1
            if "rows_per_group" not in state:
                index.rows_per_group[group_id] += 1
        return index


def check_columns(values: dict[str, list[Any]], count: int) -> None:
    wrong = {k: len(v) for k, v in values.items() if len(v) != count}
    if wrong:
        raise ValueError(f"every field needs {count} values; got {wrong}")
