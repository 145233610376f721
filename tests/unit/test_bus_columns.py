"""How bus values travel: which puts stay inline and how large tensor columns are packed."""

from __future__ import annotations

import pickle

import torch

from rlx.bus.columns import INLINE_BYTES, TensorColumn, approx_nbytes, pack


def test_a_packed_column_gives_back_each_tensor_with_its_shape():
    tensors = [torch.arange(6).view(2, 3), torch.arange(4), torch.tensor([], dtype=torch.long)]
    column = pickle.loads(pickle.dumps(TensorColumn(tensors)))
    assert len(column) == 3 and column.nbytes == 10 * 8
    for original, restored in zip(tensors, (column[i] for i in range(3))):
        assert restored.shape == original.shape and torch.equal(restored, original)


def test_only_large_puts_are_packed_and_only_their_uniform_tensor_columns():
    small = {"ids": [torch.arange(10), torch.arange(20)], "reward": [1.0, 0.0]}
    assert pack(small) is small
    rows = INLINE_BYTES // 8
    large = {"ids": [torch.arange(rows), torch.arange(rows)], "text": ["a", "b"],
             "mixed": [torch.zeros(2), torch.zeros(2, dtype=torch.long)]}
    packed = pack(large)
    assert isinstance(packed["ids"], TensorColumn) and packed["text"] == ["a", "b"]
    assert packed["mixed"] is large["mixed"]  # two dtypes cannot share one buffer


def test_size_estimates_count_what_dominates():
    assert approx_nbytes(torch.zeros(100)) == 400
    assert approx_nbytes([1, 2, 3]) == 32
    assert approx_nbytes({"a": ["xy", "z"], "b": [[1] * 10]}) == 3 + 88
