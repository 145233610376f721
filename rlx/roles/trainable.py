"""What orchestration needs of a role that trains (Actor, Critic): its version and its checkpoints,
so no worker or loop reaches into the training engine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rlx.engines.training.engine import TrainingEngine
    from rlx.weights.buckets import Bucket
    from rlx.weights.sync import WeightPublisher


class Trainable:
    engine: TrainingEngine

    @property
    def version(self) -> int:
        """Steps finished (each may take several optimizer updates): the Actor's published weight version."""
        return self.engine.step

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights, whole."""
        return self.engine.weights()

    def publish(self, publisher: WeightPublisher, rollback: bool = False) -> dict[str, float]:
        """This version's weights through DCS (timings in seconds); frozen ones are put once."""
        return publisher.publish(self.weights(), self.version, rollback, frozen=self.engine.frozen_weights())

    def weight_buckets(self, bucket_bytes: int) -> tuple[list[Bucket], list]:
        """On a rank of a group (a sharded engine): the whole weights into the object store, bucket
        by bucket; see `RankGroup.weight_buckets`."""
        return self.engine.weight_buckets(bucket_bytes)

    def save(self, directory: Path, state: dict, files: dict[str, bytes] | None = None) -> Path:
        """A checkpoint of this role alone: complete or absent, never half."""
        return self.engine.save_checkpoint(directory, state, files)

    def write(self, folder: Path, state: dict, files: dict[str, bytes] | None = None) -> None:
        """This role's part of a checkpoint that several roles (or ranks) share; the caller completes it."""
        self.engine.write_checkpoint(folder, state, files)

    def load(self, directory: Path) -> dict:
        """Restore model, optimizer and version; returns the rest of the saved state."""
        return self.engine.load_checkpoint(directory)
