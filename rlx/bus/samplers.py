"""Samplers choose which ready rows a `get` returns. Each returns [] until its rule is met."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    row_id: int
    group_id: int
    num_tokens: int
    group_rows: int | None = None  # rows its group will have, when declared (else the sampler's group size)


class Sampler(Protocol):
    def select(self, candidates: list[Candidate], batch_size: int, partial: bool) -> list[int]:
        """Row ids to hand out. `partial=True` accepts fewer than `batch_size` (e.g. end of a step)."""


class SequentialSampler:
    """Oldest ready rows first."""

    def select(self, candidates: list[Candidate], batch_size: int, partial: bool) -> list[int]:
        if len(candidates) < batch_size and not partial:
            return []
        return [c.row_id for c in candidates[:batch_size]]


class GroupSampler:
    """Whole groups only: all responses of a prompt travel together, never split. A group has
    `group_size` rows unless its producer declared another count (an agent app's episode may make
    several samples); `batch_size` asks for `batch_size // group_size` groups, whatever their rows."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def select(self, candidates: list[Candidate], batch_size: int, partial: bool) -> list[int]:
        if batch_size % self.group_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of the group size {self.group_size}")
        members: dict[int, list[int]] = {}
        expected: dict[int, int] = {}
        for c in candidates:
            members.setdefault(c.group_id, []).append(c.row_id)
            expected[c.group_id] = c.group_rows or self.group_size
        complete = [rows for group, rows in members.items() if len(rows) == expected[group]]
        wanted = batch_size // self.group_size
        if len(complete) < wanted and not partial:
            return []
        return [row for rows in complete[:wanted] for row in rows]


class TokenBudgetSampler:
    """Oldest rows until their tokens fill `max_tokens` (at least one row), for even micro-batches."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens

    def select(self, candidates: list[Candidate], batch_size: int, partial: bool) -> list[int]:
        chosen, tokens = [], 0
        for c in candidates[:batch_size]:
            if chosen and tokens + c.num_tokens > self.max_tokens:
                return chosen
            chosen.append(c.row_id)
            tokens += c.num_tokens
        full = len(chosen) == batch_size or tokens >= self.max_tokens
        return chosen if (full or partial) else []


SamplerSpec = tuple[str, int]


def make_sampler(spec: SamplerSpec | None) -> Sampler:
    """Samplers travel between processes as small specs: ("sequential", 0), ("group", n), ("tokens", budget)."""
    if spec is None or spec[0] == "sequential":
        return SequentialSampler()
    if spec[0] == "group":
        return GroupSampler(spec[1])
    if spec[0] == "tokens":
        return TokenBudgetSampler(spec[1])
    raise ValueError(f"unknown sampler {spec!r}; use sequential, group or tokens")
