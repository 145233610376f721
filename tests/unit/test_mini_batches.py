"""Mini-batch membership for PPO epochs: a seeded function of the sample uid, balanced."""

from __future__ import annotations

import random

import pytest

from rlx.engines.training.batch import mini_batch_rows


def _members(keys: list[int], count: int, seed: int = 0) -> list[set[int]]:
    return [{keys[row] for row in rows} for rows in mini_batch_rows(keys, count, seed)]


def test_rows_are_split_in_balanced_disjoint_mini_batches():
    rows = mini_batch_rows(list(range(100, 123)), 4, seed=0)
    assert sorted(r for part in rows for r in part) == list(range(23))
    assert sorted(len(part) for part in rows) == [5, 6, 6, 6]
    assert all(part == sorted(part) for part in rows), "rows keep the caller's order inside a mini-batch"


def test_membership_follows_the_uid_not_the_arrival_order():
    keys = [5, 17, 3, 42, 8, 11, 29, 1]
    shuffled = keys[:]
    random.Random(3).shuffle(shuffled)
    assert _members(keys, 3) == _members(shuffled, 3)
    assert _members(keys, 3) != _members(keys, 3, seed=1), "the seed picks another split"
    assert _members(keys, 2) != [set(keys[0::2]), set(keys[1::2])], "not simply the arrival order dealt out"


def test_fewer_rows_than_mini_batches_leaves_the_last_empty():
    assert [len(part) for part in mini_batch_rows([7, 9], 3, seed=0)] == [1, 1, 0]


def test_zero_mini_batches_is_refused_with_the_key():
    with pytest.raises(ValueError, match="train.mini_batches=0"):
        mini_batch_rows([1, 2], 0, seed=0)
