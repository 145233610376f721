"""The DCS coordinator: one Ray Serve deployment that tracks weight versions, publishers and
subscribers.

It never touches tensor bytes: the publisher puts each bucket into the object store and hands the
coordinator the references. Subscribers long-poll `wait_newer`, load the version and
`ack` it. A version older than the latest is released once every live subscriber has acknowledged
it or something newer, or was declared dead; the latest version is always kept, because new and
restarted engines start from it.

Versions normally only grow. A global recovery of the Actor from a checkpoint publishes an older
version with `rollback=True`: every newer version is forgotten and the subscribers load the
checkpoint's weights. Subscribers therefore wait on a `Position`: the coordinator's incarnation and
its count of accepted publications, which never goes back within one incarnation.

The coordinator is its own fault domain. Serve replaces a dead or hung replica in place; the new
one starts empty, under a new incarnation. Clients retry until it answers (`WeightSync`), the
Actor's next publication gives it the latest version again, and subscribers register again and
take that version as new, since a position from another incarnation is older than any.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

from rlx.weights.buckets import Bucket

Position = tuple[str, int]  # (the coordinator's incarnation, the serial of one publication)


@dataclass
class Version:
    version: int
    serial: int
    layout: list[Bucket]
    refs: list  # one ObjectRef per bucket
    published_at: float
    broadcast: dict | None = None  # {"host", "port", "epoch", "ranks": {subscriber: rank}}
    unchanged: int = 0  # leading buckets that are the same objects as the version before's (never broadcast)
    acks: dict[str, float] = field(default_factory=dict)  # subscriber -> seconds from publish to loaded


@dataclass
class Subscriber:
    name: str
    channel: str
    version: int = -1  # the last version it acknowledged
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True


def releasable(held: list[int], latest: int, acked: list[int]) -> list[int]:
    """Versions that no live subscriber can still need: older than the latest, and acknowledged
    (or passed) by every live subscriber. `acked`: each live subscriber's acknowledged version."""
    floor = min(acked, default=latest)
    return [v for v in held if v < latest and v <= floor]


def broadcast_ranks(members: list[str]) -> dict[str, int]:
    """Rank 0 is the publisher; subscribers follow in name order, so every party agrees."""
    return {name: rank for rank, name in enumerate(sorted(members), start=1)}


class WeightCoordinator:
    """Every method is a coroutine: they all run on the replica's event loop, one at a time
    between awaits, so no state needs a lock."""

    def __init__(self, subscriber_timeout_s: float = 60.0) -> None:
        self.incarnation = uuid.uuid4().hex[:12]
        self.versions: dict[int, Version] = {}
        self.latest = -1
        self.serial = -1
        self.subscribers: dict[str, Subscriber] = {}
        self.subscriber_timeout_s = subscriber_timeout_s
        self.epoch = int(time.time() * 1000)  # broadcast groups of an earlier incarnation never match a new one
        self._members: tuple[str, ...] = ()
        self._changed = asyncio.Condition()
        self.released = 0
        self.rollbacks: list[tuple[int, int]] = []  # (latest version lost, version restored)

    # publishers
    async def publish(self, version: int, layout: list[Bucket], refs: list, broadcast: dict | None = None,
                      rollback: bool = False, unchanged: int = 0) -> dict:
        """Record `version` (ignored unless newer, or `rollback`). With `broadcast` (host, port),
        returns the epoch and ranks of the live broadcast subscribers that must receive it."""
        if version <= self.latest and not rollback:
            return {"accepted": False, "latest": self.latest, "incarnation": self.incarnation}
        if rollback:  # the versions after the checkpoint belong to a lost Actor: nobody may load them now
            if self.latest >= 0:
                self.rollbacks.append((self.latest, version))
            self.versions.clear()
            for subscriber in self.subscribers.values():
                subscriber.version = -1
        if broadcast is not None:
            broadcast = {**broadcast, **self._broadcast_group()}
        self.serial += 1
        self.versions[version] = Version(version, self.serial, layout, list(refs), time.monotonic(), broadcast,
                                         unchanged)
        self.latest = version
        self._release()
        await self._notify()
        return {"accepted": True, "latest": version, "incarnation": self.incarnation, **(broadcast or {})}

    async def broadcast_failed(self, version: int) -> None:
        """A broadcast did not complete: the next one forms a new group (its subscribers fall back
        to the object-store copy of this version)."""
        self._members = ()

    def _broadcast_group(self) -> dict:
        self._expire()
        members = tuple(sorted(s.name for s in self.subscribers.values() if s.alive and s.channel != "object-store"))
        if members != self._members:
            self.epoch, self._members = self.epoch + 1, members
        return {"epoch": self.epoch, "ranks": broadcast_ranks(list(members))}

    # subscribers
    async def register(self, name: str, channel: str = "object-store", version: int = -1) -> None:
        self.subscribers[name] = Subscriber(name, channel, version)

    async def unregister(self, name: str) -> None:
        await self.mark_dead(name)

    async def mark_dead(self, name: str) -> None:
        """A dead subscriber holds no version back and leaves the broadcast group."""
        if name in self.subscribers:
            self.subscribers[name].alive = False
            self._release()

    def _is_newer(self, after: Position | None) -> bool:
        """Something is published, and after `after` (a position from another incarnation is older)."""
        return self.serial >= 0 and (after is None or after[0] != self.incarnation or self.serial > after[1])

    async def wait_newer(self, name: str | None, after: Position | None, timeout_s: float) -> dict | None:
        """The latest version if published after `after`, waiting up to `timeout_s` for one."""
        self._seen(name)
        if not await self._wait_until(lambda: self._is_newer(after), timeout_s):
            return None
        self._seen(name)
        record = self.versions[self.latest]
        return {"version": record.version, "position": (self.incarnation, record.serial), "layout": record.layout,
                "refs": record.refs, "broadcast": record.broadcast, "unchanged": record.unchanged}

    async def ack(self, name: str, version: int, load_s: float | None = None) -> None:
        record = self.versions.get(version)
        if record is not None:
            record.acks[name] = time.monotonic() - record.published_at if load_s is None else load_s
        subscriber = self.subscribers.get(name)
        if subscriber is not None:
            subscriber.version = max(subscriber.version, version)
            subscriber.last_seen = time.monotonic()
        self._release()
        await self._notify()

    async def wait_acked(self, version: int, count: int, timeout_s: float) -> dict[str, float]:
        """The acks of `version`, once `count` subscribers have loaded it or `timeout_s` passed (the
        caller sees from their number which)."""
        await self._wait_until(lambda: len(self._acks(version)) >= count, timeout_s)
        return self._acks(version)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait_until(self, condition, timeout_s: float) -> bool:
        """Whether `condition` holds now or comes to hold within `timeout_s`."""
        async with self._changed:
            if condition():
                return True
            if timeout_s <= 0:  # asyncio.wait_for(..., 0) would give up before even looking
                return False
            try:
                await asyncio.wait_for(self._changed.wait_for(condition), timeout_s)
            except TimeoutError:
                return False
            return True

    def _acks(self, version: int) -> dict[str, float]:
        record = self.versions.get(version)
        return dict(record.acks) if record else {}

    # introspection
    async def latest_version(self) -> int:
        return self.latest

    async def position_of_latest(self) -> tuple[str, int]:
        """(incarnation, latest version): how a publisher sees that a replacement needs its version."""
        return self.incarnation, self.latest

    async def status(self) -> dict:
        self._expire()
        return {
            "incarnation": self.incarnation,
            "latest": self.latest,
            "held": sorted(self.versions),
            "released": self.released,
            "epoch": self.epoch,
            "rollbacks": list(self.rollbacks),
            "subscribers": {s.name: {"version": s.version, "alive": s.alive, "channel": s.channel}
                            for s in self.subscribers.values()},
        }

    async def check_health(self) -> None:
        """Serve's health check runs on the same event loop as every call: a blocked loop fails it,
        and Serve replaces the replica."""

    # fault injection (`faults` in the config, role "dcs")
    async def inject_fault(self, kind: str) -> None:
        """kill: the process exits a moment after answering; hang: the event loop blocks, so every
        call and Serve's health check go unanswered."""
        if kind == "kill":
            threading.Timer(0.2, os._exit, args=(1,)).start()
        else:
            asyncio.get_running_loop().call_later(0.2, time.sleep, 10**6)

    def _seen(self, name: str | None) -> None:
        if name in self.subscribers:
            self.subscribers[name].last_seen = time.monotonic()
            self.subscribers[name].alive = True

    def _expire(self) -> None:
        now = time.monotonic()
        for s in self.subscribers.values():
            if s.alive and now - s.last_seen > self.subscriber_timeout_s:
                s.alive = False

    def _release(self) -> None:
        self._expire()
        live = [s.version for s in self.subscribers.values() if s.alive]
        for version in releasable(list(self.versions), self.latest, live):
            del self.versions[version]  # the coordinator's refs go; Ray frees the buckets with the last reader
            self.released += 1
