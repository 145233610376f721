"""Broadcast groups for the `gloo` and `nccl` channels: the publisher is rank 0, subscribers follow.

Each group is a standalone process-group object on a prefix of one TCP store that the publisher
serves, so a process can belong to one group per epoch without touching torch.distributed's global
default group (which the training engine may use for FSDP). A group is created when the set of
subscribers changes (a new epoch) and reused for every version until then.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class BroadcastGroup:
    def __init__(self, backend: str, store: dist.Store, host: str, epoch: int, rank: int, world_size: int,
                 timeout_s: float) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"weights.channel={backend!r} is not a broadcast backend; use one of {BACKENDS}")
        self.backend, self.epoch, self.rank, self.world_size = backend, epoch, rank, world_size
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(f"rlx-weights/epoch{epoch}/", store)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            options._timeout = timeout
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
            self.device = torch.device("cpu")
        else:  # one GPU per rank: NCCL refuses two ranks on one device
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())

    def broadcast(self, buffer: torch.Tensor) -> torch.Tensor:
        """Rank 0 sends `buffer`; every other rank receives into it. Returns the buffer."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([buffer], options).wait()
        return buffer


def serve_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The publisher's store, on a free port of `host`."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
