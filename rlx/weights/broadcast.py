"""Broadcast groups for the `gloo` and `nccl` channels: the publisher is rank 0, subscribers follow.

Each group is a standalone process-group object on a prefix of one TCP store that the publisher
serves, so a process can belong to one group per epoch without touching torch.distributed's global
default group (which the training engine may use for FSDP). A group is created when the set of
subscribers changes (a new epoch) and reused for every version until then.

The store and the gloo devices listen on one interface only (`rendezvous_host`): loopback on a
local cluster, so nothing off this machine can reach the rendezvous.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
HOST_ENV = "RLX_WEIGHTS_HOST"  # set by `start_ray` for its workers; an operator may set it to pick an interface


def rendezvous_host() -> str:
    """The interface this process's weight-channel endpoints listen on: `$RLX_WEIGHTS_HOST` (127.0.0.1
    on a local cluster), else this Ray node's IP (a joined multi-node cluster)."""
    host = os.environ.get(HOST_ENV)
    if host:
        return host
    import ray  # lazily: rlx.weights does not pull Ray in for users of the groups alone

    return ray.util.get_node_ip_address()


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


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `host` alone (a TCPStore left to itself listens on every interface)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as error:
        raise ValueError(f"weight-channel host {host!r} does not resolve ({error}); set ${HOST_ENV} to an "
                         "address of this machine, e.g. 127.0.0.1") from error
    return socket.create_server((host, port), family=family, backlog=128)


def serve_store(host: str, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """The publisher's store, listening on `host` only (`port=0`: a free port)."""
    sock = listening_socket(host, port)
    port = sock.getsockname()[1]
    # the store owns the descriptor from here on (it closes it when it is destroyed)
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.detach())


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
