"""Run state (bus snapshot, prompt-source state, counters) as data files: JSON plus safetensors.

It replaces a pickle: loading a run directory must never run code. JSON alone loses what the bus
snapshot holds, so a few tagged objects keep it exact: `{"__tuple__": [...]}` for tuples,
`{"__dict__": [[key, value], ...]}` for dicts with non-string keys (ints, tuples), and
`{"__tensor__": "t0"}` for a tensor stored under that name in `run_state.safetensors`, and
`{"__fraction__": [numerator, denominator]}` for the exact fractions task metadata carries
(reasoning-gym's gsm_symbolic). Floats
round-trip exactly (shortest repr, NaN and infinities included); NumPy scalars become Python
numbers, the one type change.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from rlx.checkpoints import legacy_message
from rlx.errors import UserError

FORMAT = 2
STATE_FILE, TENSOR_FILE, LEGACY_FILE = "run_state.json", "run_state.safetensors", "run_state.pkl"
TUPLE, DICT, TENSOR, FRACTION = "__tuple__", "__dict__", "__tensor__", "__fraction__"
_TAGS = (TUPLE, DICT, TENSOR, FRACTION)


class RunStateError(UserError):
    """Run state that cannot be written or read; the message names the file or the value."""


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {TUPLE: [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            return self._dict(value, where)
        if isinstance(value, torch.Tensor):
            name = f"t{len(self.tensors)}"
            self.tensors[name] = value.detach().to("cpu").contiguous().clone()  # safetensors: no shared storage
            return {TENSOR: name}
        if isinstance(value, np.generic):
            return self.encode(value.item(), where)
        if isinstance(value, Fraction):
            return {FRACTION: [value.numerator, value.denominator]}
        raise RunStateError(f"run state {where}: a {type(value).__name__} cannot be stored (allowed: None, bool, "
                            "int, float, str, Fraction, list, tuple, dict, torch.Tensor); put plain data on the bus")

    def _dict(self, value: dict, where: str) -> Any:
        keys = list(value)
        plain = all(isinstance(k, str) for k in keys) and not (len(keys) == 1 and keys[0] in _TAGS)
        if plain:
            return {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}
        return {DICT: [[self.encode(k, f"{where} key {k!r}"), self.encode(v, f"{where}[{k!r}]")]
                       for k, v in value.items()]}


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, body), = value.items()
        if tag == TUPLE:
            return tuple(_decode(v, tensors) for v in body)
        if tag == DICT:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in body}
        if tag == FRACTION:
            return Fraction(*body)
        if tag == TENSOR:
            if body not in tensors:
                raise RunStateError(f"{STATE_FILE} refers to tensor {body!r}, which {TENSOR_FILE} lacks: the "
                                    "checkpoint is damaged; resume from an earlier one")
            return tensors[body]
    return {k: _decode(v, tensors) for k, v in value.items()}


def encode_run_state(state: dict[str, Any]) -> dict[str, bytes]:
    """File name -> content, for a checkpoint folder."""
    encoder = _Encoder()
    body = encoder.encode(state, "run_state")
    return {STATE_FILE: json.dumps({"format": FORMAT, "state": body}).encode(),
            TENSOR_FILE: save_tensors(encoder.tensors)}


def decode_run_state(files: dict[str, bytes]) -> dict[str, Any]:
    """The inverse of `encode_run_state`."""
    try:
        document = json.loads(files[STATE_FILE])
    except json.JSONDecodeError as exc:
        raise RunStateError(f"{STATE_FILE} line {exc.lineno}: not valid JSON ({exc.msg}); the checkpoint is "
                            "damaged: resume from an earlier one") from exc
    version = document.get("format") if isinstance(document, dict) else None
    if version != FORMAT:
        raise RunStateError(f"{STATE_FILE} has format {version!r}; this rlx reads format {FORMAT}")
    return _decode(document["state"], load_tensors(files[TENSOR_FILE]))


def save_run_state(folder: Path, state: dict[str, Any]) -> None:
    for name, content in encode_run_state(state).items():
        (folder / name).write_bytes(content)


def load_run_state(folder: Path) -> dict[str, Any]:
    """The run state of checkpoint `folder`; an old pickle-only checkpoint gets the converter's name."""
    if not (folder / STATE_FILE).exists():
        if (folder / LEGACY_FILE).exists():
            raise RunStateError(legacy_message(folder, run_dir=folder.parent.parent))
        raise RunStateError(f"{folder} has no {STATE_FILE}: it is not an async-run checkpoint")
    return decode_run_state({name: (folder / name).read_bytes() for name in (STATE_FILE, TENSOR_FILE)})
