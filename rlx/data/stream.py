"""A deterministic, resumable order over prompt rows.

Epoch e visits the rows in a permutation seeded by (seed, e). The only state is `position`, the
number of rows handed out so far, so a checkpoint that stores it resumes the exact same order.
"""

from __future__ import annotations

import random

from rlx.data.rows import PromptRow


class PromptStream:
    def __init__(self, rows: list[PromptRow], seed: int, position: int = 0) -> None:
        if not rows:
            raise ValueError("PromptStream needs at least one row")
        self.rows = rows
        self.seed = seed
        self.position = position
        self._epoch, self._order = -1, list(range(len(rows)))

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self._order

    def row_at(self, index: int) -> PromptRow:
        """The row handed out at stream position `index` (to hand it out again after a crash)."""
        epoch, offset = divmod(index, len(self.rows))
        return self.rows[self._order_for(epoch)[offset]]

    def take(self, count: int) -> list[tuple[int, PromptRow]]:
        """The next `count` rows with their global index (position in the stream)."""
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.position, len(self.rows))
            out.append((self.position, self.rows[self._order_for(epoch)[offset]]))
            self.position += 1
        return out
