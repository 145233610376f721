"""Run state as JSON + safetensors: a real bus snapshot round-trips exactly, and nothing in a run
directory can make rlx run code."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from rlx.bus import LocalBus
from rlx.bus.core import BusIndex
from rlx.run_state import (
    STATE_FILE,
    TENSOR_FILE,
    RunStateError,
    decode_run_state,
    encode_run_state,
    load_run_state,
    save_run_state,
)


def assert_same(a, b, where="state"):
    """Equal values and equal types all the way down (tensors: same dtype, shape and contents)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def bus_with_rows() -> LocalBus:
    """A bus as a run leaves it: rows with rollout fields (lists, strings, dicts, None), fields
    added later by other roles, a packed tensor, and rows some tasks have consumed."""
    bus = LocalBus(capacity=64)
    rows = bus.put({"group_id": [7, 7, 9], "prompt_ids": [[1, 2], [1, 2], [3]], "response_ids": [[4], [5, 6], []],
                    "rollout_logprobs": [[-0.25], [-1e-9, -3.5], []], "behavior_version": [0, 0, 1],
                    "last_behavior_version": [None, 1, None], "finish_reason": ["stop", "length", "stop"],
                    "metadata": [{"index": 3, "tags": ["a", None]}, {}, {"nested": {"x": 1.5}}]},
                   group_ids=[7, 7, 9], num_tokens=[3, 4, 1])
    bus.put_fields(rows, {"reward": [1.0, float("nan"), -0.0], "reward_error": [None, "timeout", None],
                          "values": [torch.tensor([0.5]), torch.tensor([[1, 2]], dtype=torch.int32),
                                     torch.zeros(0)]})
    bus.get("reward", ["response_ids"], 2)
    bus.get("train", ["reward"], 1)
    bus.index.count("groups_dropped", 2)
    return bus


def test_a_real_bus_snapshot_round_trips_exactly_and_restores():
    snapshot = bus_with_rows().index.snapshot()
    state = {"bus": snapshot, "prompts": {"position": 12, "unfinished": [9, 11], "rolled_back": 0},
             "samples_per_group": {7: 2, 9: 1}}
    files = encode_run_state(state)
    assert set(files) == {STATE_FILE, TENSOR_FILE}
    decoded = decode_run_state(files)
    assert_same(decoded, state)  # int keys stay ints, row tuples stay tuples, tensors keep their dtype
    restored = BusIndex.restore(decoded["bus"])
    assert_same(restored.snapshot(), snapshot)
    assert restored.take("reward", ["response_ids"], 5, partial=True) == [2]  # consumption marks survived


def test_tricky_keys_and_values_round_trip():
    state = {"tuple_keys": {(1, "a"): [1, (2, 3)]}, "mixed": {1: "int", "1": "str"},
             "looks_like_a_tag": {"__tuple__": [1]}, "floats": [0.1, 1e308, -math.inf, 5e-324],
             "bools": [True, False, 0, 1], "empty": {}, "scalar_tensor": torch.tensor(3.0, dtype=torch.bfloat16)}
    assert_same(decode_run_state(encode_run_state(state)), state)


def test_task_metadata_of_every_built_in_reasoning_gym_task_round_trips():
    from rlx.config import build_config
    from rlx.data import load_splits

    for task in ("chain_sum", "basic_arithmetic", "countdown", "gsm_symbolic"):  # gsm_symbolic holds Fractions
        rows, _ = load_splits(build_config({"data": {"task": task, "train_size": 20, "eval_size": 2}}).data)
        metadata = [row.metadata for row in rows]
        assert decode_run_state(encode_run_state({"metadata": metadata}))["metadata"] == metadata, task


def test_numpy_scalars_become_python_numbers():
    decoded = decode_run_state(encode_run_state({"reward": np.float32(0.5), "count": np.int64(3)}))
    assert decoded == {"reward": 0.5, "count": 3} and type(decoded["count"]) is int


def test_a_value_that_is_not_data_is_named():
    with pytest.raises(RunStateError, match=r"run_state\.bus\.rows\[0\]: a set cannot be stored"):
        encode_run_state({"bus": {"rows": [{1, 2}]}})


def test_damaged_run_state_names_the_file_and_line(tmp_path):
    save_run_state(tmp_path, {"a": 1})
    (tmp_path / STATE_FILE).write_text('{"format": 2,\n "state": {oops}')
    with pytest.raises(RunStateError, match=rf"{STATE_FILE} line 2: not valid JSON"):
        load_run_state(tmp_path)
    (tmp_path / STATE_FILE).write_text(json.dumps({"format": 3, "state": {}}))
    with pytest.raises(RunStateError, match="format 3; this rlx reads format 2"):
        load_run_state(tmp_path)


class _RunsCode:
    """A pickle payload that would create a file when unpickled: the attack a run directory must not allow."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_pickle_in_a_run_directory_is_never_loaded(tmp_path, tiny):
    from rlx.config import TrainConfig
    from rlx.engines.training.engine import TrainingEngine

    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    checkpoint.mkdir(parents=True)
    pwned = tmp_path / "pwned"
    (checkpoint / "run_state.pkl").write_bytes(pickle.dumps({"samples_per_group": _RunsCode(pwned)}))
    with pytest.raises(RunStateError, match=f"rlx convert-run {tmp_path / 'run'}"):
        load_run_state(checkpoint)

    model, tokenizer = tiny
    engine = TrainingEngine(model, tokenizer, TrainConfig(), 1.0)
    engine.save_checkpoint(checkpoint, {})
    torch.save({"optimizer": _RunsCode(pwned)}, checkpoint / "optimizer.pt")  # a tampered optimizer file
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        engine.load_checkpoint(checkpoint)
    assert not pwned.exists()
