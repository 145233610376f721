"""Whole tensors into a training engine: a sharded checkpoint (`rlx.checkpoint_shards`) onto one
process or any number of ranks, and a one-process checkpoint's state onto a rank group.

Apart from `engine.py` and `fsdp.py` because both read sharded checkpoints: a one-process engine
resumes from a rank group's, and a rank group from a one-process trainer's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlx.checkpoint_shards import read_index, read_whole

if TYPE_CHECKING:
    from rlx.engines.training.engine import TrainingEngine


def load_sharded_checkpoint(engine: TrainingEngine, directory: Path) -> dict:
    """Restore `engine` (sharded over any number of ranks, or one process) from a sharded checkpoint:
    each whole tensor is assembled from the slices, then kept whole or re-sliced for this rank.
    Returns the rest of the trainer state."""
    index = read_index(directory)
    optim_state: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in read_whole(directory, "optim/").items():
        name, state = key.rsplit("/", 1)
        optim_state.setdefault(name, {})[state] = tensor
    return restore(engine, directory, read_whole(directory, "model/"), optim_state, index["state"]["param_groups"],
                   index["state"]["scheduler"])


def restore(engine: TrainingEngine, directory: Path, model_state: dict[str, torch.Tensor],
            optim_state: dict[str, dict[str, torch.Tensor]], param_groups: list[dict], scheduler: dict) -> dict:
    """Whole tensors into `engine` (each rank keeps its slices), then its step; returns the rest of
    the trainer state."""
    names = dict(engine.model.named_parameters())
    missing = names.keys() - model_state.keys()
    if missing:
        raise ValueError(f"checkpoint {directory} does not match the model: missing {sorted(missing)[:5]}")
    if len(param_groups) != 1:
        raise ValueError(f"{directory}: {len(param_groups)} optimizer parameter groups; rlx trainers use one")
    group = {**param_groups[0], "betas": tuple(param_groups[0]["betas"]), "params": list(names)}
    set_model_state_dict(engine.model, model_state, options=StateDictOptions(full_state_dict=True, strict=False))
    set_optimizer_state_dict(engine.model, engine.optimizer, {"state": optim_state, "param_groups": [group]},
                             options=StateDictOptions(full_state_dict=True))
    engine.scheduler.load_state_dict(scheduler)
    state = json.loads((directory / "trainer_state.json").read_text())
    engine.step = state.pop("step")
    return state
