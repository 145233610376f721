"""Sharded checkpoints: each rank of a trainer's rank group writes its own slice of every tensor.

In a checkpoint folder, beside `trainer_state.json`:
- `shard-00000-of-00002.safetensors`, ...: rank r's slices, keyed `model/<name>` and
  `optim/<name>/<state>` (AdamW's `exp_avg`, `exp_avg_sq`, `step`). A tensor held whole by every
  rank (a buffer, the optimizer's step count) is written by rank 0 alone.
- `shards.json`: the index, written last by rank 0: the number of ranks, each tensor's whole shape,
  and the JSON state (optimizer hyper-parameters, the lr schedule).

FSDP2 shards dim 0 in rank order, so concatenating the slices in rank order gives the whole tensor:
a checkpoint loads onto any number of ranks, or onto none (`rlx export`). Only safetensors and JSON
are read, so nothing a run folder holds can run code. This module imports nothing from the engines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads checkpoints without paying for torch's import until it must
    import torch

INDEX = "shards.json"
FORMAT = 1


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def is_sharded(folder: Path) -> bool:
    return (folder / INDEX).is_file()


def write_shard(folder: Path, rank: int, world: int, tensors: dict[str, torch.Tensor]) -> None:
    """One rank's slices (and, from rank 0, the whole tensors no rank shards)."""
    from safetensors.torch import save_file

    save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
              folder / shard_name(rank, world))


def write_index(folder: Path, world: int, shapes: dict[str, list[int]], state: dict) -> None:
    """The index, once every rank's shard is on disk: `shapes` of the whole tensors, `state` JSON data."""
    (folder / INDEX).write_text(json.dumps({"format": FORMAT, "world": world, "shapes": shapes, "state": state},
                                           indent=1))


def read_index(folder: Path) -> dict:
    index = json.loads((folder / INDEX).read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"{folder / INDEX}: sharded checkpoint format {index.get('format')!r}, this rlx reads "
                         f"{FORMAT}")
    return index


def read_whole(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor whose key starts with `prefix`, whole: the ranks' slices concatenated in rank order
    (the prefix is stripped from the returned names). A missing shard or a slice that does not add up
    to the indexed shape is an error naming the file."""
    import torch
    from safetensors import safe_open

    index = read_index(folder)
    parts: dict[str, list[torch.Tensor]] = {}
    for rank in range(index["world"]):
        path = folder / shard_name(rank, index["world"])
        if not path.is_file():
            raise FileNotFoundError(f"{path}: a shard of this {index['world']}-rank checkpoint is missing")
        with safe_open(str(path), framework="pt") as shard:
            for key in shard.keys():  # noqa: SIM118 - a safetensors reader, not a dict
                if key.startswith(prefix):
                    parts.setdefault(key, []).append(shard.get_tensor(key))
    whole = {}
    for key, slices in parts.items():
        tensor = slices[0] if len(slices) == 1 else torch.cat(slices)
        if list(tensor.shape) != index["shapes"][key]:
            raise ValueError(f"{folder}: the slices of {key} add up to {list(tensor.shape)}, the index says "
                             f"{index['shapes'][key]}: the checkpoint is damaged")
        whole[key[len(prefix):]] = tensor
    return whole
