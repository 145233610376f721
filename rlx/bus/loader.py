"""StreamingDataLoader: one training step's rows, yielded micro-batch by micro-batch as they become ready."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Protocol

from rlx.bus.samplers import SamplerSpec

POLL_S = 0.5


class BusLike(Protocol):
    def get(self, task: str, fields: list[str], batch_size: int, timeout: float | None = None,
            sampler: SamplerSpec | None = None, partial: bool = False) -> tuple[list[int], dict[str, list]]: ...

    def poll(self, task: str, fields: list[str], batch_size: int, timeout: float,
             sampler: SamplerSpec | None = None, partial: bool = False) -> tuple[list[int], dict[str, list]]: ...


class StreamingDataLoader:
    def __init__(self, bus: BusLike, task: str, fields: list[str], micro_batch_size: int,
                 rows_per_step: int | Fraction,
                 timeout: float | None = None, sampler: SamplerSpec | None = None,
                 should_stop: Callable[[], bool] = lambda: False,
                 counts: Callable[[dict[str, list]], Fraction | int] | None = None,
                 max_rows: int | None = None) -> None:
        """A step is `rows_per_step` rows, or, with `counts`, rows until `counts(values)` of each micro-batch
        add up to `rows_per_step` (e.g. only trainable rows count, or rows count in shares of their
        episode) or `max_rows` rows went by."""
        self.bus, self.task, self.fields = bus, task, fields
        self.micro_batch_size, self.rows_per_step = micro_batch_size, rows_per_step
        self.timeout, self.sampler, self.should_stop = timeout, sampler, should_stop
        self.counts, self.max_rows = counts, max_rows

    def _next(self, batch_size: int) -> tuple[list[int], dict[str, list]]:
        """Wait in short polls so a stop request is noticed; give up after `timeout` in total."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            poll = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            rows, values = self.bus.poll(self.task, self.fields, batch_size, poll, self.sampler)
            if rows:
                return rows, values
            if self.should_stop() or (deadline is not None and time.monotonic() >= deadline):
                # one last look, which raises with what was missing and how many rows were ready
                return self.bus.get(self.task, self.fields, batch_size, 0.0, self.sampler)

    def __iter__(self) -> Iterator[tuple[list[int], dict[str, list]]]:
        """After the step, `remaining` is what it still lacked: below 0 when its last row counted
        more than was left (a whole response where a share of one was missing)."""
        self.remaining, seen = Fraction(self.rows_per_step), 0  # exact: shares of an episode add up to whole rows
        while self.remaining > 0 and (self.max_rows is None or seen < self.max_rows):
            rows, values = self._next(min(self.micro_batch_size, math.ceil(self.remaining)))
            self.remaining -= len(rows) if self.counts is None else self.counts(values)
            seen += len(rows)
            yield rows, values
