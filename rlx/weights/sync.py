"""DCS clients: the Actor publishes versions, engines subscribe to them.

`WeightSync` is the small picklable handle every service gets (the coordinator's Serve handle and
the channel settings). `publisher()` and `subscriber()` build the two ends. Calls to the
coordinator retry while Serve replaces a lost coordinator, for up to `timeout_s`.

Every version goes to the object store in buckets, so a new or restarted engine can always pull
the latest version, never a checkpoint from disk. Tensors the trainer never changes
(`train.trainable` froze them: a language model under a trained adapter) sit in buckets of their
own, put into the object store once and named again in every later version; only the other
buckets are put (and broadcast) each step.

The buckets belong to the publishing process
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

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from rlx.weights.broadcast import BroadcastGroup, join_store, rendezvous_host, serve_store
from rlx.weights.buckets import Bucket, flat_bucket, flat_from_buffer, flat_size, plan_buckets, unpack_flat
from rlx.weights.coordinator import Position, WeightCoordinator

log = logging.getLogger(__name__)

CHANNELS = ("object-store", "gloo", "nccl")
StateDict = dict[str, torch.Tensor]
Loader = Callable[[StateDict, int], None]


class WeightSyncTimeout(TimeoutError):
    """No weight version arrived in time; the message says what waited and which setting to raise."""


class CoordinatorUnavailable(ConnectionError):
    """The coordinator did not answer within `weights.timeout_s`, retries included."""


RETRY_S = 0.2  # between two tries while the coordinator is being replaced


_OFF_LOOP = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlx-dcs-call")


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class WeightSync:
    coordinator: DeploymentHandle
    app: str  # the coordinator's Serve application
    channel: str = "object-store"
    bucket_bytes: int = 256 << 20
    timeout_s: float = 60.0

    @classmethod
    def create(cls, channel: str = "object-store", bucket_mb: float = 256, timeout_s: float = 60.0) -> WeightSync:
        """Deploy a coordinator as its own Serve application (Serve must be running): Serve checks
        its health every second and replaces it in place when it dies or hangs."""
        if channel not in CHANNELS:
            raise ValueError(f"weights.channel={channel!r} is not a channel; use one of {', '.join(CHANNELS)}")
        deployment = serve.deployment(
            WeightCoordinator, name="dcs", num_replicas=1,
            # its calls are short coroutines: on Serve's own loop they skip a thread hop (-20% latency)
            ray_actor_options={"num_cpus": 0,
                               "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}},
            max_ongoing_requests=1024,  # every subscriber keeps a long poll open
            health_check_period_s=1, health_check_timeout_s=5)
        app = f"rlx-dcs-{uuid.uuid4().hex[:8]}"
        handle = serve.run(deployment.bind(), name=app, route_prefix=None)
        return cls(handle, app, channel, int(bucket_mb * (1 << 20)), timeout_s)

    def close(self) -> None:
        serve.delete(self.app)

    def ask(self, method: str, *args: Any, reply_s: float = 30.0, patience_s: float | None = None,
             stop: threading.Event | None = None) -> Any:
        """A coordinator call, retried while Serve replaces a lost coordinator, for up to
        `patience_s` (default `timeout_s`): a replacement starts empty, and every call here is safe
        to repeat. An error raised by the coordinator itself is not retried; `stop` ends the
        retries early (a closing subscriber)."""
        if _on_event_loop():  # Serve refuses a blocking wait there (a replica's constructor runs on one)
            return _OFF_LOOP.submit(self.ask, method, *args, reply_s=reply_s, patience_s=patience_s,
                                    stop=stop).result()
        patience_s = self.timeout_s if patience_s is None else patience_s
        deadline = time.monotonic() + patience_s
        while True:
            response = getattr(self.coordinator, method).remote(*args)
            try:
                return response.result(timeout_s=reply_s)
            except ray.exceptions.RayTaskError:
                raise
            except (ray.exceptions.RayError, RayServeException, TimeoutError) as error:
                response.cancel()  # not left queued on a hung replica
                if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                    raise CoordinatorUnavailable(
                        f"the weight coordinator (DCS) did not answer {method} within {patience_s:.0f}s "
                        f"({type(error).__name__}); see `rlx status` and its Serve log, or raise "
                        "weights.timeout_s") from error
                time.sleep(RETRY_S)

    def tell(self, method: str, *args: Any) -> None:
        """A call nobody waits for (acks, goodbyes): lost if the coordinator is down, which is
        harmless, since a replacement starts without the state it would update."""
        getattr(self.coordinator, method).remote(*args)

    def publisher(self, refill: bool = False) -> WeightPublisher:
        return WeightPublisher(self, refill)

    def subscriber(self, name: str, load: Loader) -> WeightSubscriber:
        return WeightSubscriber(self, name, load)

    def version(self) -> int:
        return self.ask("latest_version")

    def status(self) -> dict:
        return self.ask("status")

    def wait_acked(self, version: int, count: int, timeout_s: float) -> dict[str, float]:
        """Block until `count` subscribers have loaded `version` (or `timeout_s` passed); its acks."""
        return self.ask("wait_acked", version, count, timeout_s, reply_s=timeout_s + 30)

    def forget(self, subscriber: str) -> None:
        """Declare a subscriber dead (the HealthManager does, for replicas it replaced)."""
        self.tell("mark_dead", subscriber)

    def inject_fault(self, kind: str) -> None:
        """Fault injection: kill or hang the coordinator's replica (`faults`, role `dcs`). Told,
        not called: a retry would hit the replacement too."""
        self.tell("inject_fault", kind)

    def fetch_latest(self, after: Position | None = None, wait_s: float = 0.0, name: str | None = None) -> Fetched | None:
        """The latest version if it was published after `after`, from the object store. Its state
        dict views the buckets (zero-copy, read-only) while the `Fetched` is alive."""
        record = self.ask("wait_newer", name, after, wait_s, reply_s=wait_s + 30)
        if record is None:
            return None
        return Fetched(record["version"], record["position"], from_object_store(record["layout"], record["refs"]),
                       record["refs"])


@dataclass
class Fetched:
    version: int
    position: Position  # what "newer" means to the coordinator, rollbacks and its restarts included
    state_dict: StateDict
    refs: list  # keep the buckets alive while the state dict is in use


class WeightReader:
    """For a one-off reader, such as the driver's evaluator, that needs no subscription."""

    def __init__(self, sync: WeightSync) -> None:
        self.sync, self.position = sync, None

    def pull(self, load: Loader) -> bool:
        """Load the latest version through `load(state_dict, version)` if it is new to us."""
        fetched = self.sync.fetch_latest(after=self.position)
        if fetched is None:
            return False
        load(fetched.state_dict, fetched.version)
        self.position = fetched.position
        return True


def from_object_store(layout: list[Bucket], refs: list) -> StateDict:
    """The state dict of published buckets, viewing them in the object store (zero-copy, read-only)."""
    state: StateDict = {}
    for bucket, buffer in zip(layout, ray.get(list(refs))):
        state.update(unpack_flat(flat_from_buffer(buffer), bucket))
    return state


class WeightPublisher:
    """The Actor's end. `publish` returns once the version is in the object store and, on a
    broadcast channel, once every live subscriber has received it.

    With `refill` it keeps its last version's buckets and watches the coordinator: a replacement
    starts empty, and an engine starting meanwhile may be what the Actor's next step waits for
    (decoupled PPO's ActorFwd), so the publisher hands the replacement its last version at once."""

    refill_s = 1.0  # how often a refilling publisher checks the coordinator

    def __init__(self, sync: WeightSync, refill: bool = False) -> None:
        self.sync = sync
        self._layout: tuple[tuple, list[Bucket], int] | None = None  # key, buckets, how many hold frozen tensors
        self._frozen_refs: list | None = None  # the frozen buckets of the current layout, once put
        self._group: BroadcastGroup | None = None
        self._store = None
        if sync.channel != "object-store":
            self.host = rendezvous_host()
            self._store = serve_store(self.host, sync.timeout_s)
        self._last: tuple[int, list[Bucket], list] | None = None  # version, layout, bucket refs
        self._incarnation: str | None = None  # of the coordinator that holds `_last`
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        if refill:
            self._watcher = threading.Thread(target=self._refill_forever, name="weights-publisher", daemon=True)
            self._watcher.start()

    def close(self) -> None:
        """Stop watching: the thread must not be inside a Ray call when its process shuts Ray down."""
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(timeout=self.refill_s + 10)

    def _refill_forever(self) -> None:
        while not self._closed.wait(self.refill_s):
            try:
                incarnation, latest = self.sync.ask("position_of_latest", stop=self._closed)
                last = self._last
                if last is not None and incarnation != self._incarnation and latest < last[0]:
                    version, layout, refs = last
                    result = self.sync.ask("publish", version, layout, refs, None, False, stop=self._closed)
                    self._incarnation = result["incarnation"]
                    log.warning("the weight coordinator was replaced: handed it version %d again", version)
            except Exception as error:  # noqa: BLE001 - keep watching: the coordinator may be on its way back
                if not self._closed.is_set():
                    log.warning("weight publisher: %s", error)

    def layout(self, state_dict: StateDict, frozen: frozenset[str] = frozenset()) -> tuple[list[Bucket], int]:
        """The buckets of `state_dict`: the `frozen` tensors first, in buckets of their own, and how
        many buckets those fill."""
        key = (tuple((name, tuple(t.shape), t.dtype) for name, t in state_dict.items()), frozen)
        if self._layout is None or self._layout[0] != key:
            still = {name: t for name, t in state_dict.items() if name in frozen}
            moving = {name: t for name, t in state_dict.items() if name not in frozen}
            fixed = plan_buckets(still, self.sync.bucket_bytes) if still else []
            self._layout = (key, fixed + plan_buckets(moving, self.sync.bucket_bytes), len(fixed))
            self._frozen_refs = None  # a new layout: its frozen buckets are put anew
        return self._layout[1], self._layout[2]

    def publish(self, state_dict: StateDict, version: int, rollback: bool = False,
                frozen: frozenset[str] = frozenset()) -> dict[str, float]:
        """Timings in seconds: `put_s` (into the object store), `broadcast_s` (0 on object-store).
        `rollback`: publish even if not newer, and make everyone forget newer versions (an Actor
        that restarted from a checkpoint). `frozen`: names of tensors no step changes; their
        buckets are put once (again after a rollback) and reused by later versions."""
        started = time.monotonic()
        layout, fixed = self.layout(state_dict, frozen)
        unchanged = fixed if self._frozen_refs is not None and not rollback else 0
        # one numpy buffer per bucket: the object store copies it once, at memcpy speed
        refs = (self._frozen_refs or [])[:unchanged]
        refs += [ray.put(flat_bucket(state_dict, bucket).cpu().numpy()) for bucket in layout[unchanged:]]
        self._frozen_refs = refs[:fixed]
        flats = (flat_bucket(state_dict, bucket) for bucket in layout[unchanged:])
        return self._announce(layout, refs, version, rollback, time.monotonic() - started, flats, unchanged)

    def publish_buckets(self, layout: list[Bucket], refs: list, version: int, rollback: bool = False,
                        put_s: float = 0.0) -> dict[str, float]:
        """Publish buckets already in the object store (a sharded Actor's rank 0 put them there, one
        gathered bucket at a time); a broadcast channel reads them back one at a time."""
        flats = (flat_from_buffer(ray.get(ref)) for ref in refs)
        return self._announce(layout, refs, version, rollback, put_s, flats)

    def _announce(self, layout: list[Bucket], refs: list, version: int, rollback: bool, put_s: float,
                  flats: Iterator[torch.Tensor], unchanged: int = 0) -> dict[str, float]:
        """Tell the coordinator, then broadcast `flats` (the buckets in order, but the first
        `unchanged`: the same objects as in the version before) on a broadcast channel."""
        broadcast = None if self._store is None else {"host": self.host, "port": self._store.port}
        result = self.sync.ask("publish", version, layout, refs, broadcast, rollback, unchanged)
        if result["accepted"] and self._watcher is not None:
            self._last, self._incarnation = (version, layout, refs), result["incarnation"]
        broadcast_s = 0.0
        if result["accepted"] and result.get("ranks"):
            broadcast_started = time.monotonic()
            try:
                self._broadcast(flats, result["epoch"], len(result["ranks"]) + 1)
            except Exception as error:  # noqa: BLE001 - a dead or slow subscriber: it loads from the object store instead
                log.warning("weight broadcast of version %d failed (%s); subscribers fall back to the object store",
                            version, error)
                self._group = None
                self.sync.tell("broadcast_failed", version)
            broadcast_s = time.monotonic() - broadcast_started
        return {"put_s": put_s, "broadcast_s": broadcast_s}

    def _broadcast(self, flats: Iterator[torch.Tensor], epoch: int, world_size: int) -> None:
        if self._group is None or self._group.epoch != epoch:
            self._group = BroadcastGroup(self.sync.channel, self._store, self.host, epoch, 0, world_size,
                                         self.sync.timeout_s)
        for flat in flats:
            self._group.broadcast(flat.to(self._group.device))


class WeightSubscriber:
    """An engine's end. `start` blocks until the engine holds the latest version; after that a
    thread receives newer versions and `apply` (called between decode steps) loads the newest."""

    poll_s = 1.0  # a long poll also tells the coordinator this subscriber is alive

    def __init__(self, sync: WeightSync, name: str, load: Loader) -> None:
        self.sync, self.name, self.load = sync, name, load
        self.version = -1
        self._position: Position | None = None
        self._pending: tuple[Fetched, float] | None = None
        self._lock = threading.Lock()
        self._received = threading.Event()  # set while a received version waits for `apply`
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
        latest = self.sync.fetch_latest(wait_s=wait_s, name=self.name)
        if latest is None:
            raise WeightSyncTimeout(f"weight subscriber {self.name!r} waited {wait_s:.0f} s for a first weight version "
                                    "and none was published; is the Actor running? (raise weights.timeout_s)")
        self.load(latest.state_dict, latest.version)
        self.version, self._position = latest.version, latest.position
        self.sync.ask("register", self.name, self.sync.channel, latest.version)
        self.sync.tell("ack", self.name, latest.version)
        self._thread = threading.Thread(target=self._receive_forever, name=f"weights-{self.name}", daemon=True)
        self._thread.start()
        return latest.version

    def apply(self) -> bool:
        """Load the newest received version, if any; True when the weights changed."""
        with self._lock:
            pending, self._pending = self._pending, None
            self._received.clear()
        if pending is None:
            return False
        fetched, received_at = pending
        self.load(fetched.state_dict, fetched.version)
        self.version = fetched.version
        self.sync.tell("ack", self.name, fetched.version, time.monotonic() - received_at)
        return True

    def wait_received(self, timeout_s: float) -> bool:
        """Wait until a newer version is ready for `apply` (an engine with nothing else to do)."""
        return self._received.wait(timeout_s)

    def close(self) -> None:
        """Stop receiving and wait for the thread: one left inside a Ray call while its process
        shuts Ray down (or starts a new cluster) takes the whole process with it."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 10)
        try:
            self.sync.tell("unregister", self.name)
        except Exception as error:  # noqa: BLE001 - the cluster may be going down with us; the coordinator then goes too
            log.debug("weight subscriber %s could not unregister: %s", self.name, error)

    def _receive_forever(self) -> None:
        received = self._position
        while not self._stop.is_set():
            try:
                record = self.sync.ask("wait_newer", self.name, received, self.poll_s, reply_s=self.poll_s + 30,
                                        stop=self._stop)
                if record is None:
                    continue
                if received is not None and record["position"][0] != received[0]:  # a replaced coordinator
                    self.sync.ask("register", self.name, self.sync.channel, self.version)
                started = time.monotonic()
                fetched = Fetched(record["version"], record["position"], self._receive(record), record["refs"])
                with self._lock:
                    self._pending = (fetched, started)
                    self._received.set()
                received = record["position"]
            except SystemExit:  # Ray shut down under this thread (the process is ending)
                return
            except Exception as error:  # noqa: BLE001 - keep receiving: the next version may well arrive
                if not self._stop.is_set():
                    log.warning("weight subscriber %s: %s", self.name, error)
                    time.sleep(1.0)

    def _receive(self, record: dict) -> StateDict:
        broadcast = record["broadcast"]
        rank = (broadcast or {}).get("ranks", {}).get(self.name)
        if rank is None:
            return from_object_store(record["layout"], record["refs"])
        try:
            group = self._join(broadcast, rank)
            unchanged = record["unchanged"]  # not broadcast: the object store holds them (frozen tensors)
            state: StateDict = {}
            for bucket in record["layout"][unchanged:]:  # first: the publisher waits on every rank
                buffer = torch.empty(flat_size(bucket), dtype=torch.uint8, device=group.device)
                state.update(unpack_flat(group.broadcast(buffer).cpu(), bucket))
            self.received_by_broadcast += 1
            return {**from_object_store(record["layout"][:unchanged], record["refs"][:unchanged]), **state}
        except Exception as error:  # noqa: BLE001 - any broadcast failure: the object store still has the version
            log.warning("weight subscriber %s missed the broadcast of version %d (%s); loading it from the object "
                        "store", self.name, record["version"], error)
            self._group = None
            return from_object_store(record["layout"], record["refs"])

    def _join(self, broadcast: dict, rank: int) -> BroadcastGroup:
        if self._group is None or self._group.epoch != broadcast["epoch"]:
            if self._store is None or self._store_address != (broadcast["host"], broadcast["port"]):
                self._store = join_store(broadcast["host"], broadcast["port"], self.sync.timeout_s)
                self._store_address = (broadcast["host"], broadcast["port"])
            self._group = BroadcastGroup(self.sync.channel, self._store, rendezvous_host(),
                                         broadcast["epoch"], rank,
                                         len(broadcast["ranks"]) + 1, self.sync.timeout_s)
        return self._group
