"""How column values travel: small ones as they are, large tensor columns as one flat buffer.

Pickling a list of tensors costs a fixed ~0.1 ms per tensor; one flat tensor plus its shapes costs
one. Rows of a packed column come back as views into the shared buffer (read-only in spirit: the
bus hands the same buffer to every row of the put).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import torch

INLINE_BYTES = 64 * 1024  # below this a put stays in the bus actor's memory: no object-store round trip


class TensorColumn:
    """A column of CPU tensors of one dtype, stored as one flat tensor."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        self.shapes = [tuple(t.shape) for t in tensors]
        self.offsets = [0, *accumulate(t.numel() for t in tensors)]

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.flat[self.offsets[index]:self.offsets[index + 1]].view(self.shapes[index])

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes


def approx_nbytes(value: Any, depth: int = 0) -> int:
    """A cheap size estimate for choosing inline vs object store; exact only for arrays and tensors."""
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple)):
        if not value or depth > 2 or isinstance(value[0], (int, float, bool)) or value[0] is None:
            return 8 * len(value) + 8
        return sum(approx_nbytes(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return sum(approx_nbytes(v, depth + 1) for v in value.values())
    return 16


def _packable(column: list[Any]) -> bool:
    first = column[0] if column else None
    return (isinstance(first, torch.Tensor) and len(column) > 1
            and all(isinstance(t, torch.Tensor) and t.dtype == first.dtype and t.device.type == "cpu"
                    for t in column))


def pack(values: dict[str, list[Any]]) -> dict[str, Any]:
    """Columns for a put: a large put's tensor columns become `TensorColumn`s; the rest is unchanged."""
    if approx_nbytes(values) <= INLINE_BYTES:
        return values
    return {name: TensorColumn(column) if _packable(column) else column for name, column in values.items()}
