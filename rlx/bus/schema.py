"""The bus's schema check: every put held to its field's declaration (dtype, shape, scope).

The declarations are the role plan's `FieldSpec`s (`rlx.orchestration.plan.FIELDS`); the bus sits
below the plan, so it takes them as an argument (`check_schema`) and reads only their `name`,
`writer`, `dtype`, `shape` and `scope`. Off by default (it costs a pass over every value); the
test suite turns it on, so a writer that puts a field of the wrong kind fails where it writes.

A value of None is always allowed: a field may be absent on one row (a filtered sample has no
reference log-probs). A row's token counts (`T`: `response_ids`, `P`: `prompt_ids`) come from its
first put and are remembered, so a later per-token field is checked against them.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

DIMENSION_OF = {"T": "response_ids", "P": "prompt_ids"}  # named dimensions whose size a row's field gives
JSON = (dict, list, str, int, float, bool)


class FieldDeclaration(Protocol):
    """What the check reads of a field's declaration (`rlx.orchestration.plan.FieldSpec`)."""

    name: str
    writer: str
    dtype: str
    shape: tuple[str, ...]
    scope: str


class SchemaError(ValueError):
    """A put that does not match its field's declaration."""


def _element_ok(dtype: str, value: Any) -> bool:
    """One scalar (or one element of a list) against `dtype`."""
    if dtype in ("int64", "int16"):
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if dtype == "float32":
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if dtype == "str":
        return isinstance(value, str)
    if dtype == "json":
        return isinstance(value, JSON)
    if dtype == "media":  # the model's media inputs: a dict of tensors, or one such dict per observation
        return isinstance(value, dict) or (isinstance(value, (tuple, list)) and all(isinstance(v, dict) for v in value))
    raise SchemaError(f"unknown dtype {dtype!r} in a field declaration")


def _tensor_ok(dtype: str, value: torch.Tensor) -> bool:
    if dtype == "float32":
        return value.is_floating_point()
    return str(value.dtype) == f"torch.{dtype}"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {len(value)} ({', '.join(kinds) or 'empty'})"
    return f"{type(value).__name__} {value!r:.60}"


@dataclass(frozen=True)
class Declared:
    """A field's declaration as the check keeps it: plain data, so a bus actor can receive it."""

    name: str
    writer: str
    dtype: str
    shape: tuple[str, ...]
    scope: str


class Schema:
    """The declared fields by name (None: the check is off), and the token counts of the rows put so far."""

    def __init__(self, fields: Iterable[FieldDeclaration] | None) -> None:
        self.fields = None if fields is None else {
            f.name: Declared(f.name, f.writer, f.dtype, tuple(f.shape), f.scope) for f in fields}
        self.sizes: dict[int, dict[str, int]] = {}  # row id -> its sizes of `T` and `P`

    def check_rows(self, row_ids: list[int], values: Mapping[str, Any]) -> None:
        """A put of new rows (row scope); remembers each row's token counts."""
        if self.fields is None:
            return
        for i, row_id in enumerate(row_ids):
            self.sizes[row_id] = {dim: len(values[name][i]) for dim, name in DIMENSION_OF.items()
                                  if name in values and values[name][i] is not None}
        self.check_fields(row_ids, values)

    def check_fields(self, row_ids: list[int], values: Mapping[str, Any]) -> None:
        """A put of fields of existing rows (row scope)."""
        if self.fields is None:
            return
        for name, column in values.items():
            spec = self._spec(name, "row")
            for i, row_id in enumerate(row_ids):
                self._check(spec, column[i], self.sizes.get(row_id, {}), f"row {row_id}")

    def check_group(self, group_id: int, values: Mapping[str, Any]) -> None:
        """A put of a group's shared fields (group scope)."""
        if self.fields is None:
            return
        for name, value in values.items():
            self._check(self._spec(name, "group"), value, {}, f"group {group_id}")

    def reset(self) -> None:
        """The bus was restored from a snapshot: no row's token counts are known."""
        self.sizes.clear()

    def forget(self, row_ids: Iterable[int]) -> None:
        """Rows that left the bus."""
        for row_id in row_ids:
            self.sizes.pop(row_id, None)

    def _spec(self, name: str, scope: str) -> Declared:
        spec = self.fields.get(name)
        if spec is None:
            raise SchemaError(f"bus field {name!r} is not declared: add its FieldSpec to FIELDS in "
                              "rlx/orchestration/plan.py (and its attribute to Sample), or fix the name")
        if spec.scope != scope:
            put = "put_group" if spec.scope == "group" else "put or put_fields"
            raise SchemaError(f"bus field {name!r} (written by {spec.writer!r}) has scope {spec.scope!r} and came "
                              f"in a {scope}-scoped put: write it with {put}")
        return spec

    def _check(self, spec: Declared, value: Any, sizes: Mapping[str, int], where: str) -> None:
        if value is None or self._matches(spec, value, sizes):
            return
        dims = "".join(f"[{d}={sizes[d]}]" if d in sizes else f"[{d}]" for d in spec.shape) or " scalar"
        raise SchemaError(f"bus field {spec.name!r} (written by {spec.writer!r}), {where}: expected {spec.dtype}{dims}, "
                          f"got {_describe(value)}")

    @staticmethod
    def _matches(spec: Declared, value: Any, sizes: Mapping[str, int]) -> bool:
        if not spec.shape:
            return not isinstance(value, torch.Tensor) and _element_ok(spec.dtype, value)
        if isinstance(value, torch.Tensor):
            if value.dim() != len(spec.shape) or not _tensor_ok(spec.dtype, value):
                return False
            lengths = list(value.shape)
        else:
            if len(spec.shape) != 1 or not isinstance(value, (list, tuple)):
                return False
            # one element per Python type: a list of a thousand floats costs one set, not a thousand checks
            kinds = set(map(type, value))
            if not all(_element_ok(spec.dtype, next(v for v in value if type(v) is kind)) for kind in kinds):
                return False
            lengths = [len(value)]
        return all(sizes.get(dim, length) == length for dim, length in zip(spec.shape, lengths))
