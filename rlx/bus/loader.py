"""StreamingDataLoader: one training step's rows, yielded micro-batch by micro-batch as they become ready."""

from __future__ import annotations

from typing import Iterator, Protocol

from rlx.bus.samplers import SamplerSpec


class BusLike(Protocol):
    def get(self, task: str, fields: list[str], batch_size: int, timeout: float | None = None,
            sampler: SamplerSpec | None = None, partial: bool = False) -> tuple[list[int], dict[str, list]]: ...


class StreamingDataLoader:
    def __init__(self, bus: BusLike, task: str, fields: list[str], micro_batch_size: int, rows_per_step: int,
                 timeout: float | None = None, sampler: SamplerSpec | None = None) -> None:
        self.bus, self.task, self.fields = bus, task, fields
        self.micro_batch_size, self.rows_per_step = micro_batch_size, rows_per_step
        self.timeout, self.sampler = timeout, sampler

    def __iter__(self) -> Iterator[tuple[list[int], dict[str, list]]]:
        remaining = self.rows_per_step
        while remaining > 0:
            rows, values = self.bus.get(self.task, self.fields, min(self.micro_batch_size, remaining),
                                        self.timeout, self.sampler)
            remaining -= len(rows)
            yield rows, values
