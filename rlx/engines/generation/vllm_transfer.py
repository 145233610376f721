"""`rlx_gloo`: a weight-transfer backend for vLLM servers, so weights reach one without disk on a CPU.

vLLM's online RL API (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`; served with `VLLM_SERVER_DEV_MODE=1`) loads new weights through a
pluggable backend chosen at launch (`--weight-transfer-config '{"backend": ...}'`). Its built-in
`nccl` and `ipc` backends need CUDA. This one does what `nccl` does over gloo: the client (rlx's
`vllm` URL adapter) is rank 0 of a process group it hosts, each vLLM worker joins at
`rank_offset + its rank`, and every update announces names, dtypes and shapes while the client
broadcasts the tensors in that order; the worker loads them with the model's own `load_weights`
inside vLLM's layerwise-reload lifecycle, as the `nccl` backend does.

rlx registers it in every vLLM process of an environment where rlx is installed (entry point
`vllm.general_plugins`: `register`). Only this module imports vLLM; it runs in the server.

Dev mode's routes take no API key, so what they pass here is checked before anything is allocated:
dtypes from `WIRE_DTYPES`, shapes of non-negative sizes whose bytes together stay within the
model's own (`UPDATE_SLACK` times), a group timeout of at most `MAX_TIMEOUT_S`. Anyone who reaches
the server can still point its workers at a store of theirs: keep it on loopback or a private
network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

from rlx.engines.generation.server_client import (
    MAX_GROUP_TIMEOUT_S,
    WeightGroup,
    broadcast_tensors,
    interface_towards,
    process_group,
)

BACKEND = "rlx_gloo"
WIRE_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")}
MAX_TIMEOUT_S = MAX_GROUP_TIMEOUT_S
UPDATE_SLACK = 2  # an update may announce up to this many times the model's parameter bytes (layouts differ)


def register() -> None:
    """vLLM's plugin hook: make `rlx_gloo` a weight-transfer backend of this process."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")


@dataclass
class GlooInitInfo:
    """Where the client's store listens and who joins: the client is rank 0, workers follow."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "rlx_weights"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s <= MAX_TIMEOUT_S):
            raise ValueError(f"timeout_s={self.timeout_s!r} must be a number in (0, {MAX_TIMEOUT_S:g}]")
        for name in ("master_port", "rank_offset", "world_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a non-negative integer")


@dataclass
class GlooUpdateInfo:
    """One update's tensors, in broadcast order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names ({len(self.names)}), dtype_names ({len(self.dtype_names)}) and shapes "
                             f"({len(self.shapes)}) differ in length")
        for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes):
            if dtype not in WIRE_DTYPES:
                raise ValueError(f"{name!r}: dtype {dtype!r} is not a weight dtype; one of {sorted(WIRE_DTYPES)}")
            if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                    for d in shape)):
                raise ValueError(f"{name!r}: shape {shape!r} is not a list of non-negative sizes")

    def nbytes(self) -> int:
        return sum(math.prod(shape) * WIRE_DTYPES[dtype].itemsize for dtype, shape in zip(self.dtype_names, self.shapes))


class GlooWeightTransferEngine(WeightTransferEngine):
    """vLLM's `WeightTransferEngine` over a gloo group (see the module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.group: WeightGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join at a rank unique over every data-parallel group (as vLLM's `nccl` backend counts),
        listening on the interface that reaches the client."""
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        timeout = timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(init_info.master_address, init_info.master_port, is_master=False, timeout=timeout)
        self.group = process_group(store, init_info.group_name, "gloo", rank, init_info.world_size, timeout,
                                   interface_towards(init_info.master_address, init_info.master_port))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receive every tensor first, then load: the group stays in step even when loading fails."""
        if self.group is None:
            raise RuntimeError("the rlx_gloo weight transfer is not initialised: POST /init_weight_transfer_engine")
        model_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if update_info.nbytes() > UPDATE_SLACK * model_bytes:
            raise ValueError(f"the update announces {update_info.nbytes()} bytes, more than {UPDATE_SLACK}x the "
                             f"model's {model_bytes}: refused before allocating")
        tensors = [torch.empty(shape, dtype=WIRE_DTYPES[dtype])
                   for dtype, shape in zip(update_info.dtype_names, update_info.shapes)]
        broadcast_tensors(self.group, tensors)
        with disable_mtp_completeness_check():  # a chunk holds part of the model, as in vLLM's nccl backend
            self.model.load_weights([(name, tensor.to(self.device))
                                     for name, tensor in zip(update_info.names, tensors)])

    def shutdown(self) -> None:
        self.group = None
