"""Where a model's parameters live: whole in this process (`OneProcess`), or sliced over the ranks
of a process group (`rlx.engines.training.fsdp.Fsdp2`).

The training engine and the forward-only roles (Reference, Teacher, ActorFwd) are one class each;
what differs on a rank of a group is handed to them as a `Placement`: the passes every rank must
run alike, the votes and sums over the ranks, and how whole weights and checkpoints enter and
leave. So a sharded role is the one-process role with another placement, not a subclass of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from rlx.engines.training.engine import TrainingEngine
    from rlx.weights.buckets import Bucket

T = TypeVar("T")


class Placement(Protocol):
    world: int  # ranks holding a slice of each parameter (1: the whole model here)

    def in_lockstep(self, passes: list[T]) -> list[T]:
        """`passes`, padded with repeats so that every rank runs as many (each forward is collective)."""

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank."""

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """`values` summed key by key over the ranks."""

    def after_forward(self, model: torch.nn.Module) -> None:
        """Free what a forward without a backward left gathered."""

    def load_weights(self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Whole weights into `model` (a rank keeps its slices)."""

    def weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole weights, detached, for publishing."""

    def weight_buckets(self, model: torch.nn.Module, bucket_bytes: int) -> tuple[list[Bucket], list[Any]]:
        """The whole weights into the object store, bucket by bucket (a rank group's way out)."""

    def write_checkpoint(self, engine: TrainingEngine, folder: Path, extra_state: dict,
                         extra_files: dict[str, bytes] | None) -> None:
        """The engine's model, optimizer, step, `extra_state` and `extra_files` into `folder`."""

    def load_checkpoint(self, engine: TrainingEngine, directory: Path) -> dict:
        """A one-process checkpoint into the engine; returns the rest of the trainer state."""


class OneProcess:
    """The whole model in this process: no collective, every hook the plain one."""

    world = 1

    def in_lockstep(self, passes: list[T]) -> list[T]:
        return passes

    def all_true(self, flag: bool) -> bool:
        return flag

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        return values

    def after_forward(self, model: torch.nn.Module) -> None:
        pass

    def load_weights(self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        model.load_state_dict(state_dict, strict=True)

    def weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in model.state_dict().items()}

    def weight_buckets(self, model: torch.nn.Module, bucket_bytes: int) -> tuple[list[Bucket], list[Any]]:
        raise RuntimeError("weight_buckets serves a rank group (RankGroup.weight_buckets); a one-process trainer "
                           "publishes weights() directly")

    def write_checkpoint(self, engine: TrainingEngine, folder: Path, extra_state: dict,
                         extra_files: dict[str, bytes] | None) -> None:
        """A Hugging Face folder, `optimizer.pt`, `trainer_state.json` and `extra_files`."""
        engine.export(folder)
        torch.save({"optimizer": engine.optimizer.state_dict(), "scheduler": engine.scheduler.state_dict()},
                   folder / "optimizer.pt")
        (folder / "trainer_state.json").write_text(json.dumps({"step": engine.step, **extra_state}, indent=2))
        for name, content in (extra_files or {}).items():
            (folder / name).write_bytes(content)

    def load_checkpoint(self, engine: TrainingEngine, directory: Path) -> dict:
        """Reads data only: safetensors, JSON, and the optimizer with `weights_only=True` (no pickled
        code runs)."""
        from safetensors.torch import load_file

        model = engine.model
        state = load_file(directory / "model.safetensors")
        if not state.keys() <= model.state_dict().keys():
            # transformers writes some families (MoE experts) in their original per-expert layout;
            # `from_pretrained` converts them back to the model's own (fused) layout
            dtype = next(model.parameters()).dtype
            state = type(model).from_pretrained(directory, dtype=dtype, use_safetensors=True).state_dict()
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {k for k in missing if k == "lm_head.weight" and model.config.tie_word_embeddings}
        if set(missing) - tied or unexpected:
            raise ValueError(f"checkpoint {directory} does not match the model: missing={missing} unexpected={unexpected}")
        optim = torch.load(directory / "optimizer.pt", weights_only=True)
        engine.optimizer.load_state_dict(optim["optimizer"])
        engine.scheduler.load_state_dict(optim["scheduler"])
        state = json.loads((directory / "trainer_state.json").read_text())
        engine.step = state.pop("step")
        return state


ONE_PROCESS = OneProcess()
