"""DCS clients: the Actor publishes versions, engines subscribe to them.

`WeightSync` is the small picklable handle every service gets (the coordinator's handle and the
channel settings). `publisher()` and `subscriber()` build the two ends.

Every version goes to the object store in buckets, so a new or restarted engine can always pull
the latest version, never a checkpoint from disk. The buckets belong to the publishing process
(Ray 2.56 removed `ray.put(_owner=...)`, and routing 500 MB through the coordinator would cost a
copy): if the Actor dies its versions go with it, and engines wait for the recovered Actor to
publish again. On the `gloo`
and `nccl` channels the Actor also broadcasts each bucket to the live subscribers, which then
skip the object store; a subscriber that misses a broadcast falls back to the object-store copy.

A subscriber receives on its own thread, so neither the publisher nor the engine waits for the
other; the engine applies a received version between its decode steps (`apply`), which is the
"pause, load, resume" of generation: sequences in flight keep their place and continue on the new
weights, and each records the versions it was generated with.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
import torch

from rlx.weights.broadcast import BroadcastGroup, join_store, serve_store
from rlx.weights.buckets import (
    Bucket,
    flat_size,
    from_arrays,
    pack_flat,
    plan_buckets,
    to_arrays,
    unpack_flat,
)
from rlx.weights.coordinator import WeightCoordinator

log = logging.getLogger(__name__)

CHANNELS = ("object-store", "gloo", "nccl")
StateDict = dict[str, torch.Tensor]
Loader = Callable[[StateDict, int], None]


class WeightSyncTimeout(TimeoutError):
    """No weight version arrived in time; the message says what waited and which setting to raise."""


@dataclass(frozen=True)
class WeightSync:
    coordinator: ray.actor.ActorHandle
    channel: str = "object-store"
    bucket_bytes: int = 256 << 20
    timeout_s: float = 60.0

    @classmethod
    def create(cls, channel: str = "object-store", bucket_mb: float = 256, timeout_s: float = 60.0) -> WeightSync:
        if channel not in CHANNELS:
            raise ValueError(f"weights.channel={channel!r} is not a channel; use one of {', '.join(CHANNELS)}")
        return cls(WeightCoordinator.remote(), channel, int(bucket_mb * (1 << 20)), timeout_s)

    def publisher(self) -> WeightPublisher:
        return WeightPublisher(self)

    def subscriber(self, name: str, load: Loader) -> WeightSubscriber:
        return WeightSubscriber(self, name, load)

    def version(self) -> int:
        return ray.get(self.coordinator.latest_version.remote())

    def status(self) -> dict:
        return ray.get(self.coordinator.status.remote())

    def forget(self, subscriber: str) -> None:
        """Declare a subscriber dead (the HealthManager does, for replicas it replaced)."""
        self.coordinator.mark_dead.remote(subscriber)

    def fetch_latest(self, than_serial: int = -1, wait_s: float = 0.0, name: str | None = None) -> Fetched | None:
        """The latest version if it was published after `than_serial`, from the object store. Its
        state dict views the buckets (zero-copy, read-only) while the `Fetched` is alive."""
        record = ray.get(self.coordinator.wait_newer.remote(name, than_serial, wait_s))
        if record is None:
            return None
        return Fetched(record["version"], record["serial"], _from_object_store(record["layout"], record["refs"]),
                       record["refs"])


@dataclass
class Fetched:
    version: int
    serial: int  # the coordinator's count of publications: what "newer" means, rollbacks included
    state_dict: StateDict
    refs: list  # keep the buckets alive while the state dict is in use


class WeightReader:
    """For a one-off reader, such as the driver's evaluator, that needs no subscription."""

    def __init__(self, sync: WeightSync) -> None:
        self.sync, self.serial = sync, -1

    def pull(self, load: Loader) -> bool:
        """Load the latest version through `load(state_dict, version)` if it is new to us."""
        fetched = self.sync.fetch_latest(than_serial=self.serial)
        if fetched is None:
            return False
        load(fetched.state_dict, fetched.version)
        self.serial = fetched.serial
        return True


def _from_object_store(layout: list[Bucket], refs: list) -> StateDict:
    state: StateDict = {}
    for bucket, arrays in zip(layout, ray.get(list(refs))):
        state.update(from_arrays(arrays, bucket))
    return state


class WeightPublisher:
    """The Actor's end. `publish` returns once the version is in the object store and, on a
    broadcast channel, once every live subscriber has received it."""

    def __init__(self, sync: WeightSync) -> None:
        self.sync = sync
        self._layout: tuple[tuple, list[Bucket]] | None = None
        self._group: BroadcastGroup | None = None
        self._store = None
        if sync.channel != "object-store":
            self.host = ray.util.get_node_ip_address()
            self._store = serve_store(self.host, sync.timeout_s)

    def layout(self, state_dict: StateDict) -> list[Bucket]:
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in state_dict.items())
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, plan_buckets(state_dict, self.sync.bucket_bytes))
        return self._layout[1]

    def publish(self, state_dict: StateDict, version: int, rollback: bool = False) -> dict[str, float]:
        """Timings in seconds: `put_s` (into the object store), `broadcast_s` (0 on object-store).
        `rollback`: publish even if not newer, and make everyone forget newer versions (an Actor
        that restarted from a checkpoint)."""
        started = time.monotonic()
        layout = self.layout(state_dict)
        refs = [ray.put(to_arrays(state_dict, bucket)) for bucket in layout]
        put_s = time.monotonic() - started
        broadcast = None if self._store is None else {"host": self.host, "port": self._store.port}
        result = ray.get(self.sync.coordinator.publish.remote(version, layout, refs, broadcast, rollback))
        broadcast_s = 0.0
        if result["accepted"] and result.get("ranks"):
            broadcast_started = time.monotonic()
            try:
                self._broadcast(state_dict, layout, result["epoch"], len(result["ranks"]) + 1)
            except Exception as error:  # a dead or slow subscriber: it loads from the object store instead
                log.warning("weight broadcast of version %d failed (%s); subscribers fall back to the object store",
                            version, error)
                self._group = None
                ray.get(self.sync.coordinator.broadcast_failed.remote(version))
            broadcast_s = time.monotonic() - broadcast_started
        return {"put_s": put_s, "broadcast_s": broadcast_s}

    def _broadcast(self, state_dict: StateDict, layout: list[Bucket], epoch: int, world_size: int) -> None:
        if self._group is None or self._group.epoch != epoch:
            self._group = BroadcastGroup(self.sync.channel, self._store, self.host, epoch, 0, world_size,
                                         self.sync.timeout_s)
        for bucket in layout:
            self._group.broadcast(pack_flat(state_dict, bucket).to(self._group.device))


class WeightSubscriber:
    """An engine's end. `start` blocks until the engine holds the latest version; after that a
    thread receives newer versions and `apply` (called between decode steps) loads the newest."""

    poll_s = 1.0  # a long poll also tells the coordinator this subscriber is alive

    def __init__(self, sync: WeightSync, name: str, load: Loader) -> None:
        self.sync, self.name, self.load = sync, name, load
        self.version = -1
        self._serial = -1
        self._pending: tuple[Fetched, float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._group: BroadcastGroup | None = None
        self._store = None
        self._store_address: tuple[str, int] | None = None
        self.received_by_broadcast = 0

    def start(self, wait_s: float | None = None) -> int:
        """Load the latest published version (waiting up to `wait_s` for the first one), register,
        and start receiving. Returns the version loaded."""
        wait_s = self.sync.timeout_s if wait_s is None else wait_s
        latest = self.sync.fetch_latest(than_serial=-1, wait_s=wait_s, name=self.name)
        if latest is None:
            raise WeightSyncTimeout(f"weight subscriber {self.name!r} waited {wait_s:.0f} s for a first weight version "
                                    "and none was published; is the Actor running? (raise weights.timeout_s)")
        self.load(latest.state_dict, latest.version)
        self.version, self._serial = latest.version, latest.serial
        ray.get(self.sync.coordinator.register.remote(self.name, self.sync.channel, latest.version))
        self.sync.coordinator.ack.remote(self.name, latest.version)
        self._thread = threading.Thread(target=self._receive_forever, name=f"weights-{self.name}", daemon=True)
        self._thread.start()
        return latest.version

    def apply(self) -> bool:
        """Load the newest received version, if any; True when the weights changed."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        fetched, received_at = pending
        self.load(fetched.state_dict, fetched.version)
        self.version = fetched.version
        self.sync.coordinator.ack.remote(self.name, fetched.version, time.monotonic() - received_at)
        return True

    def close(self) -> None:
        """Stop receiving and wait for the thread: one left inside a Ray call while its process
        shuts Ray down (or starts a new cluster) takes the whole process with it."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 10)
        try:
            self.sync.coordinator.unregister.remote(self.name)
        except Exception as error:  # the cluster may be going down with us; the coordinator then goes too
            log.debug("weight subscriber %s could not unregister: %s", self.name, error)

    def _receive_forever(self) -> None:
        received = self._serial
        while not self._stop.is_set():
            try:
                record = ray.get(self.sync.coordinator.wait_newer.remote(self.name, received, self.poll_s))
                if record is None:
                    continue
                started = time.monotonic()
                fetched = Fetched(record["version"], record["serial"], self._receive(record), record["refs"])
                with self._lock:
                    self._pending = (fetched, started)
                received = record["serial"]
            except SystemExit:  # Ray shut down under this thread (the process is ending)
                return
            except Exception as error:  # keep receiving: the next version may well arrive
                if not self._stop.is_set():
                    log.warning("weight subscriber %s: %s", self.name, error)
                    time.sleep(1.0)

    def _receive(self, record: dict) -> StateDict:
        broadcast = record["broadcast"]
        rank = (broadcast or {}).get("ranks", {}).get(self.name)
        if rank is None:
            return _from_object_store(record["layout"], record["refs"])
        try:
            group = self._join(broadcast, rank)
            state: StateDict = {}
            for bucket in record["layout"]:
                buffer = torch.empty(flat_size(bucket), dtype=torch.uint8, device=group.device)
                state.update(unpack_flat(group.broadcast(buffer).cpu(), bucket))
            self.received_by_broadcast += 1
            return state
        except Exception as error:
            log.warning("weight subscriber %s missed the broadcast of version %d (%s); loading it from the object "
                        "store", self.name, record["version"], error)
            self._group = None
            return _from_object_store(record["layout"], record["refs"])

    def _join(self, broadcast: dict, rank: int) -> BroadcastGroup:
        if self._group is None or self._group.epoch != broadcast["epoch"]:
            if self._store is None or self._store_address != (broadcast["host"], broadcast["port"]):
                self._store = join_store(broadcast["host"], broadcast["port"], self.sync.timeout_s)
                self._store_address = (broadcast["host"], broadcast["port"])
            self._group = BroadcastGroup(self.sync.channel, self._store, ray.util.get_node_ip_address(),
                                         broadcast["epoch"], rank,
                                         len(broadcast["ranks"]) + 1, self.sync.timeout_s)
        return self._group
