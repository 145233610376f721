"""Split a state dict into size-bounded buckets and rebuild it on the other side.

A bucket is a list of tensors that travels as one flat byte buffer (an object in the object
store, or one broadcast). Tensors travel as raw bytes with their dtype and shape beside them, so any
dtype works (numpy has no bfloat16). Tensors that share storage (tied embeddings) travel once and
come back under every name.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

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
    larger tensor gets a bucket of its own). Sharded tensors (DTensor) are planned at their whole
    shape; call it on a rank whose shards are not empty (rank 0), as empty storages look alike."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    first_name: dict[tuple, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, tensor in state_dict.items():
        held = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # a shard: its rank's storage
        key = (held.untyped_storage().data_ptr(), held.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if key in first_name:
            aliases[first_name[key]].append(name)
        else:
            first_name[key] = name
            aliases[name] = []
    buckets: list[Bucket] = []
    current: Bucket = []
    size = 0
    for name, names in aliases.items():
        spec = _spec(name, state_dict[name], tuple(names))
        if current and size + spec.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(current)
    return buckets


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _named(tensors: list[torch.Tensor], bucket: Bucket) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for spec, tensor in zip(bucket, tensors):
        for name in (spec.name, *spec.aliases):
            out[name] = tensor
    return out


def _offsets(bucket: Bucket) -> tuple[list[int], int]:
    offsets, end = [], 0
    for spec in bucket:
        offsets.append(end)
        end += -(-spec.nbytes // ALIGN) * ALIGN
    return offsets, end


def flat_size(bucket: Bucket) -> int:
    return _offsets(bucket)[1]


def _empty_flat(bucket: Bucket, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """An uninitialised flat buffer for the bucket, with only its alignment padding zeroed (so the
    bytes sent are deterministic), and the tensors' offsets."""
    offsets, size = _offsets(bucket)
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    for spec, offset, end in zip(bucket, offsets, [*offsets[1:], size]):
        flat[offset + spec.nbytes : end].zero_()
    return flat, offsets


def pack_flat(state_dict: dict[str, torch.Tensor], bucket: Bucket) -> torch.Tensor:
    """One contiguous byte buffer holding the bucket, on the tensors' device (a copy)."""
    flat, offsets = _empty_flat(bucket, state_dict[bucket[0].name].device)
    for spec, offset in zip(bucket, offsets):
        flat[offset : offset + spec.nbytes] = _as_bytes(state_dict[spec.name])
    return flat


def flat_view(state_dict: dict[str, torch.Tensor], bucket: Bucket) -> torch.Tensor | None:
    """The bucket as one byte buffer without a copy, when its tensors already sit in one storage
    at the bucket's offsets (a model after `flatten_parameters`); None otherwise."""
    offsets, size = _offsets(bucket)
    first = state_dict[bucket[0].name]
    storage = first.untyped_storage()
    base = first.data_ptr()
    for spec, offset in zip(bucket, offsets):
        tensor = state_dict[spec.name]
        if (not tensor.is_contiguous() or tensor.data_ptr() != base + offset or tensor.device != first.device
                or tensor.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
    start = base - storage.data_ptr()
    if start + size > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (size,))


def flat_bucket(state_dict: dict[str, torch.Tensor], bucket: Bucket) -> torch.Tensor:
    """The bucket as one byte buffer: a view when the model is flattened, else a packed copy.
    One buffer per bucket is what makes a publish cost one memory copy: Ray copies a single large
    buffer into the object store at memcpy speed, but pays per buffer for hundreds of tensors."""
    view = flat_view(state_dict, bucket)
    return pack_flat(state_dict, bucket) if view is None else view


def flatten_parameters(module: torch.nn.Module, bucket_bytes: int) -> list[Bucket]:
    """Move the module's parameters and buffers into one storage per bucket, laid out as
    `plan_buckets` plans its state dict, so publishing its weights needs no packing copy. Call it
    before an optimizer is built: parameters keep their identity, but their data moves."""
    state = module.state_dict(keep_vars=True)
    layout = plan_buckets(state, bucket_bytes)
    for bucket in layout:
        device = state[bucket[0].name].device
        if any(state[spec.name].device != device for spec in bucket):  # a model split over devices: packed
            continue
        flat, offsets = _empty_flat(bucket, device)
        for spec, offset in zip(bucket, offsets):
            view = flat[offset : offset + spec.nbytes].view(spec.torch_dtype).view(spec.shape)
            view.copy_(state[spec.name].detach())
            for name in (spec.name, *spec.aliases):  # tied names are usually one Parameter, not always
                state[name].data = view
    return layout


def flat_from_buffer(buffer) -> torch.Tensor:
    """A byte tensor over a buffer from the object store: zero-copy and read-only, so engines copy
    it into their parameters or use it for inference only."""
    if memoryview(buffer).nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # object-store buffers are read-only by design; say it once, here
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(memoryview(buffer), dtype=torch.uint8)


def unpack_flat(flat: torch.Tensor, bucket: Bucket) -> dict[str, torch.Tensor]:
    """Views into `flat`, one per tensor of the bucket."""
    offsets, size = _offsets(bucket)
    if flat.numel() != size:
        raise ValueError(f"a flat bucket of {flat.numel()} bytes does not match its layout of {size} bytes")
    tensors = [flat[offset : offset + spec.nbytes].view(spec.torch_dtype).view(spec.shape)
               for spec, offset in zip(bucket, offsets)]
    return _named(tensors, bucket)
