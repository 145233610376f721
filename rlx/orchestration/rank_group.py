"""One trainer role (Actor, Critic), or a forward-only one (Reference, Teacher), as a group of N
rank processes over one sharded model.

`RankGroup` stands where the role would: the workers, colocate's loop and the Serve deployment call
it as they call an `Actor`, a `Critic` or a `Reference`. It places N Ray actors together (a
STRICT_PACK placement group), each joins one torch.distributed process group (gloo on CPU, nccl on
CUDA; rendezvous at a store rank 0 serves on one interface) and builds the role over a `ShardedTrainingEngine` (a
`ShardedReference` for a forward-only role). Every call then runs on every rank in lockstep, since
each forward and backward gathers parameters collectively:

- a micro-batch is split over the ranks by token count; a rank left without samples runs a stand-in
  pass over one of them with its loss multiplied by zero (`counted=False`), so every rank runs the
  same passes;
- the step's metrics, token and sequence counts are summed over the ranks inside the role;
- weights leave the group bucket by bucket: the ranks gather one bucket, rank 0 puts it in the
  object store, and only the refs come back (DCS publishes them as they are);
- checkpoints: each rank writes its slices into the one staging folder this process opened.

The group is one fault domain: a rank that dies fails the call, and with it the role, which then
recovers as a single-process one does (its replica is replaced and the run resumes from the last
checkpoint). The driver talks to the bus; the ranks only see the samples it hands them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlx.checkpoints import staged_checkpoint
from rlx.data.sample import Sample
from rlx.weights.broadcast import join_store, rendezvous_host, serve_store
from rlx.weights.buckets import Bucket
from rlx.weights.sync import WeightPublisher, from_object_store

if TYPE_CHECKING:
    import torch

START_TIMEOUT_S = 300.0
COLOCATED_BUCKET_BYTES = 256 << 20  # weights handed to a colocated engine travel in buckets this size


def split_by_tokens(samples: list[Sample], ranks: int) -> list[list[int]]:
    """Indices of `samples` for each rank: longest first onto the rank with the fewest tokens so
    far (ties: the lower rank), each part in the original order. Deterministic."""
    loads = [0] * ranks
    parts: list[list[int]] = [[] for _ in range(ranks)]
    by_length = sorted(range(len(samples)), key=lambda i: (-(len(samples[i].prompt_ids) + len(samples[i].response_ids)), i))
    for i in by_length:
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        parts[rank].append(i)
        loads[rank] += len(samples[i].prompt_ids) + len(samples[i].response_ids)
    return [sorted(part) for part in parts]


_RANK_OF_GROUP = False  # set in a RankProcess before its role is built


def is_rank_of_group() -> bool:
    """Whether this process is a rank of an rlx rank group (its roles shard their models).

    Not `torch.distributed.is_initialized()`: a library may start a process group of its own in
    any process (vLLM does, world size 1, when a colocated run builds its engine)."""
    return _RANK_OF_GROUP


def _mark_rank_of_group() -> None:
    """Set from a `RankProcess`. A function of this module, not a `global` statement in the actor's
    method: Ray ships the actor's class by value, with a copy of this module's globals."""
    global _RANK_OF_GROUP
    _RANK_OF_GROUP = True


class RankLost(RuntimeError):
    """A rank process of the group died: the group (and the role) cannot go on."""


@ray.remote
class RankProcess:
    """One rank: joins the process group, builds the role, runs what the group asks of it."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.role, self.store = rank, world, None, None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 serves the group's store on one interface (`rendezvous_host`: loopback on a local
        cluster; torch's own `tcp://` rendezvous would listen on every one) and says where it is."""
        host = rendezvous_host()
        self.store = serve_store(host, START_TIMEOUT_S)
        return host, self.store.port

    def start(self, address: tuple[str, int], backend: str, threads: int, build: Callable[[], Any]) -> None:
        import torch
        import torch.distributed as dist

        host, port = address
        if host.startswith("127."):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo would otherwise pick the hostname's interface
        torch.set_num_threads(threads)
        store = self.store if self.rank == 0 else join_store(host, port, START_TIMEOUT_S)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world)
        _mark_rank_of_group()
        self.role = build()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.role, method)(*args, **kwargs)

    def get(self, attribute: str) -> Any:
        return getattr(self.role, attribute)

    def memory(self) -> dict[str, int]:
        import resource

        import psutil

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {**self.role.engine.tensor_bytes(), "rss": psutil.Process().memory_info().rss, "peak_rss": peak}


class RankGroup:
    """The role of `build` (run on each rank after it joined the group) over `ranks` processes."""

    def __init__(self, build: Callable[[], Any], ranks: int, num_cpus: float, num_gpus: float, threads: int,
                 name: str = "actor") -> None:
        if ranks < 1:
            raise ValueError(f"a rank group needs at least 1 rank, not {ranks}")
        self.name, self.ranks = name, ranks
        self.on_rank_lost: Callable[[], None] | None = None
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        self._group = placement_group([bundle] * ranks, strategy="STRICT_PACK")  # unnamed: a replacement replica makes its own
        try:
            ray.get(self._group.ready(), timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as late:
            remove_placement_group(self._group)
            raise RuntimeError(f"resources.{name}.ranks={ranks}: the cluster cannot place {ranks} ranks of "
                               f"{bundle} together on one node; lower the ranks or the per-rank resources") from late
        self._processes = [
            RankProcess.options(num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=rank)).remote(rank, ranks)
            for rank in range(ranks)]
        self.address = ray.get(self._processes[0].rendezvous.remote())  # (host, port) of the group's store
        backend = "nccl" if num_gpus else "gloo"
        ray.get([p.start.remote(self.address, backend, threads, build) for p in self._processes],
                timeout=START_TIMEOUT_S)
        self._version: int | None = None  # a trainer's steps finished, read once it is asked for

    # -- lockstep calls --------------------------------------------------------------------------
    def _get(self, refs):
        """`ray.get`, where a dead rank is the loss of the whole group: `on_rank_lost` runs (the
        Actor's service ends its replica there, so the role recovers as a crashed one does), else
        RankLost is raised."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as lost:
            if self.on_rank_lost is not None:
                self.on_rank_lost()
            raise RankLost(f"a rank of the {self.name}'s group died: {lost}") from lost

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._get([p.call.remote(method, *args, **kwargs) for p in self._processes])

    def _first(self, attribute: str) -> Any:
        return self._get(self._processes[0].get.remote(attribute))

    def _spread(self, method: str, samples: list[Sample], counted: bool = False) -> tuple[list[list[int]], list[Any]]:
        """`method(share)` on every rank over its share of `samples`; a rank whose share is empty
        gets a stand-in (the first sample), passed with `counted=False` when `counted` is asked for,
        and its result is dropped."""
        parts = split_by_tokens(samples, self.ranks)
        results = self._get([
            p.call.remote(method, [samples[i] for i in part] if part else samples[:1],
                          **({"counted": bool(part)} if counted else {}))
            for p, part in zip(self._processes, parts)])
        return parts, results

    # -- the role's interface (Trainable, Actor, Critic) -----------------------------------------
    @property
    def version(self) -> int:
        if self._version is None:
            self._version = self._first("version")
        return self._version

    def begin_step(self) -> None:
        self._all("begin_step")

    def accumulate(self, samples: list[Sample]) -> None:
        self._spread("accumulate", samples, counted=True)

    def finish_step(self) -> dict[str, float]:
        metrics = self._all("finish_step")[0]
        self._version = self._first("version")
        return metrics

    def values(self, samples: list[Sample]) -> list[list[float]]:
        """The Critic's values, each rank valuing its share, back in the order of `samples`."""
        return self._rows("values", samples)

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """A Reference's (Teacher's) log-probs, each rank scoring its share, in the order of `samples`."""
        return self._rows("logprobs", samples)

    def _rows(self, method: str, samples: list[Sample]) -> list[list[float]]:
        parts, results = self._spread(method, samples)
        out: list[list[float]] = [[] for _ in samples]
        for part, rows in zip(parts, results):
            for i, row in zip(part, rows):
                out[i] = row
        return out

    @property
    def refresh_every(self) -> int:
        return self._first("refresh_every")

    @property
    def weight_version(self) -> int:
        return self._first("weight_version")

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """ActorFwd's new version: put once in the object store; every rank loads it whole and keeps its slices."""
        self._all("load_weights", ray.put(state_dict), version)

    def refresh(self, state_dict: dict[str, torch.Tensor], version: int) -> bool:
        """A Reference that follows the policy: every rank takes the same decision and, when due,
        loads the whole weights (put once in the object store) and keeps its slices."""
        return self._all("refresh", ray.put(state_dict), version)[0]

    def weight_buckets(self, bucket_bytes: int) -> tuple[list[Bucket], list[ray.ObjectRef]]:
        """The whole weights in the object store, in the layout a single-process Actor publishes."""
        return self._all("weight_buckets", bucket_bytes)[0]

    def weights(self) -> dict[str, torch.Tensor]:
        """The whole weights for an engine in this process (colocated), read from the buckets."""
        return from_object_store(*self.weight_buckets(COLOCATED_BUCKET_BYTES))

    def publish(self, publisher: WeightPublisher, rollback: bool = False) -> dict[str, float]:
        """A new version through DCS straight from the ranks' buckets: nothing passes through here."""
        started = time.monotonic()
        layout, refs = self.weight_buckets(publisher.sync.bucket_bytes)
        return publisher.publish_buckets(layout, refs, self.version, rollback, put_s=time.monotonic() - started)

    def memory(self) -> list[dict[str, int]]:
        """Per rank: bytes of its parameter, gradient and optimizer-state shards, its RSS and peak RSS."""
        return self._get([p.memory.remote() for p in self._processes])

    def save(self, directory: Path, state: dict, files: dict[str, bytes] | None = None) -> Path:
        with staged_checkpoint(directory) as staging:
            self._all("write", staging, state, files)
        return directory

    def write(self, folder: Path, state: dict, files: dict[str, bytes] | None = None) -> None:
        self._all("write", folder, state, files)

    def load(self, directory: Path) -> dict:
        state = self._all("load", directory)[0]
        self._version = self._first("version")
        return state

    def close(self) -> None:
        """End the rank processes and free their placement."""
        for process in self._processes:
            ray.kill(process)
        remove_placement_group(self._group)
