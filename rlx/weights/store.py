"""The simplest correct weight hand-off: the trainer puts its state dict in Ray's object store and a
small actor records which version is the latest. Engines poll the version and load newer weights.

This is the interface the weight-sync service (DCS) slots in behind: publish(version), version(),
fetch_newer(than).
"""

from __future__ import annotations

from typing import Callable

import ray
import torch


@ray.remote(num_cpus=0)
class _LatestWeights:
    def __init__(self) -> None:
        self.version = -1
        self.refs: list = []

    def publish(self, version: int, refs: list) -> None:
        if version > self.version:
            self.version, self.refs = version, refs

    def latest_version(self) -> int:
        return self.version

    def latest(self) -> tuple[int, list]:
        return self.version, self.refs


class WeightStore:
    def __init__(self, actor: ray.actor.ActorHandle) -> None:
        self.actor = actor

    @classmethod
    def create(cls) -> WeightStore:
        return cls(_LatestWeights.remote())

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        ref = ray.put({k: v.detach().cpu() for k, v in state_dict.items()})
        ray.get(self.actor.publish.remote(version, [ref]))

    def version(self) -> int:
        return ray.get(self.actor.latest_version.remote())

    def fetch_newer(self, than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        version, refs = ray.get(self.actor.latest.remote())
        if version <= than or not refs:
            return None
        return version, ray.get(refs[0])

    def pull(self, current_version: int, load: Callable[[dict[str, torch.Tensor], int], None]) -> None:
        """Load the latest weights through `load(state_dict, version)` if they are newer than ours."""
        newer = self.fetch_newer(than=current_version)
        if newer is not None:
            load(newer[1], newer[0])
