"""Split a state dict into size-bounded buckets and rebuild it on the other side.

A bucket is a list of tensors sent as one object (object-store channel) or one flat byte buffer
(broadcast channels). Tensors travel as raw bytes with their dtype and shape beside them, so any
dtype works (numpy has no bfloat16). Tensors that share storage (tied embeddings) travel once and
come back under every name.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 64  # byte offset alignment inside a flat bucket, so every view is aligned for its dtype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    nbytes: int
    aliases: tuple[str, ...] = ()  # other names of the same tensor

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


Bucket = list[TensorSpec]


def _spec(name: str, tensor: torch.Tensor, aliases: tuple[str, ...]) -> TensorSpec:
    return TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                      tensor.numel() * tensor.element_size(), aliases)


def plan_buckets(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Group tensors, in state-dict order, into buckets of at most `bucket_bytes` each (a single
    larger tensor gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    first_name: dict[tuple, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if key in first_name:
            aliases[first_name[key]].append(name)
        else:
            first_name[key] = name
            aliases[name] = []
    buckets: list[Bucket] = []
    current: Bucket = []
    size = 0
    for name in aliases:
        spec = _spec(name, state_dict[name], tuple(aliases[name]))
        if current and size + spec.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(current)
    return buckets


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def to_arrays(state_dict: dict[str, torch.Tensor], bucket: Bucket) -> list[np.ndarray]:
    """The bucket's tensors as byte arrays that view the tensors' own memory (no copy on CPU): the
    object store copies them once, when they are put."""
    return [_as_bytes(state_dict[spec.name]).numpy() for spec in bucket]


def _named(tensors: list[torch.Tensor], bucket: Bucket) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for spec, tensor in zip(bucket, tensors):
        for name in (spec.name, *spec.aliases):
            out[name] = tensor
    return out


def from_arrays(arrays: list[np.ndarray], bucket: Bucket) -> dict[str, torch.Tensor]:
    """Tensors that view the arrays (zero-copy from the object store, so they are read-only:
    engines copy them into their parameters or use them for inference only)."""
    if len(arrays) != len(bucket):
        raise ValueError(f"a bucket of {len(bucket)} tensors arrived with {len(arrays)} arrays")
    tensors = []
    with warnings.catch_warnings():  # object-store buffers are read-only by design; say it once, here
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for spec, array in zip(bucket, arrays):
            raw = torch.frombuffer(memoryview(array), dtype=torch.uint8) if array.nbytes else torch.empty(0, dtype=torch.uint8)
            tensors.append(raw.view(spec.torch_dtype).view(spec.shape))
    return _named(tensors, bucket)


def _offsets(bucket: Bucket) -> tuple[list[int], int]:
    offsets, end = [], 0
    for spec in bucket:
        offsets.append(end)
        end += -(-spec.nbytes // ALIGN) * ALIGN
    return offsets, end


def flat_size(bucket: Bucket) -> int:
    return _offsets(bucket)[1]


def pack_flat(state_dict: dict[str, torch.Tensor], bucket: Bucket) -> torch.Tensor:
    """One contiguous byte buffer holding the bucket (what a broadcast sends)."""
    offsets, size = _offsets(bucket)
    flat = torch.empty(size, dtype=torch.uint8)
    for spec, offset in zip(bucket, offsets):
        flat[offset : offset + spec.nbytes] = _as_bytes(state_dict[spec.name])
    return flat


def unpack_flat(flat: torch.Tensor, bucket: Bucket) -> dict[str, torch.Tensor]:
    """Views into `flat`, one per tensor of the bucket."""
    offsets, size = _offsets(bucket)
    if flat.numel() != size:
        raise ValueError(f"a flat bucket of {flat.numel()} bytes does not match its layout of {size} bytes")
    tensors = [flat[offset : offset + spec.nbytes].view(spec.torch_dtype).view(spec.shape)
               for spec, offset in zip(bucket, offsets)]
    return _named(tensors, bucket)
