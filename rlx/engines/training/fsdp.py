"""FSDP2: a model sliced over the ranks of a process group (one rank of a trainer's or of a
forward-only role's rank group).

Every rank holds a slice of each parameter, of its gradient and of its AdamW state
(`torch.distributed.fsdp.fully_shard` on each decoder layer, then on the root); a forward gathers a
layer's parameters just before it runs and frees them after. Each rank's micro-batches add their
summed losses; FSDP2 averages the gradients over the ranks (gloo has no pre-scaled sum), so the
update multiplies them back by the number of ranks and divides once by the step's *global* token
(or sequence) count: the update does not depend on the number of ranks.

The engine and the roles are the one-process classes (`TrainingEngine`, `rlx.roles.Reference`);
`Fsdp2` is their placement (`rlx.engines.training.placement`) on a rank. The rank group
(`rlx.orchestration.rank_group`) runs every call on every rank in lockstep; all collectives
(gathers in forward and backward, the gradient norm, the finiteness vote, the metric sums, the
bucket-by-bucket weight gather) happen in the same order on each. Checkpoints are sharded: each
rank writes its own slices (`rlx.checkpoint_shards`), and a checkpoint loads onto any number of
ranks (`rlx.engines.training.restore`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlx.checkpoint_shards import write_index, write_shard
from rlx.config import TrainConfig
from rlx.engines.training.engine import Forward, TrainingEngine
from rlx.engines.training.restore import restore
from rlx.weights.buckets import Bucket, pack_flat, plan_buckets

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
T = TypeVar("T")


def shard_model(model: PreTrainedModel, config: TrainConfig) -> None:
    """`fully_shard` every decoder layer of the language model (the classes transformers names in
    `_no_split_modules`), then the root. Media encoders stay in the root unit: rlx calls them before
    the forward's body (each media object encoded once), which a unit of their own would refuse as a
    call from outside the root's forward (`rlx.engines.training.forward.call_with_media`).
    bf16 training gathers bf16 parameters and reduces gradients in `reduce_dtype`; the sharded
    master weights and AdamW state stay float32."""
    policy = MixedPrecisionPolicy(param_dtype=_DTYPES[config.param_dtype], reduce_dtype=_DTYPES[config.reduce_dtype])
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.get_decoder().modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer classes (_no_split_modules): rlx cannot "
                         "shard it layer by layer; train it with resources.<role>.ranks=1")
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def in_lockstep(passes: list[T]) -> list[T]:
    """`passes`, then repeats of the first until every rank has as many as the busiest (each
    forward gathers parameters collectively); the caller drops the repeats' outputs."""
    most = torch.tensor([len(passes)])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return passes + passes[:1] * (int(most.item()) - len(passes))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered from every rank (a collective); a replicated one as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class Fsdp2:
    """The placement of an FSDP2-sharded model on one rank of an initialised process group."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("an FSDP2-sharded role runs on a rank of a process group: start it through "
                               "rlx.orchestration.rank_group.RankGroup")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def in_lockstep(self, passes: list[T]) -> list[T]:
        return in_lockstep(passes)

    def all_true(self, flag: bool) -> bool:
        vote = torch.tensor([1 if flag else 0])
        dist.all_reduce(vote, op=dist.ReduceOp.MIN)
        return bool(vote.item())

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        gathered: list[dict[str, float]] = [{} for _ in range(self.world)]
        dist.all_gather_object(gathered, values)
        total: dict[str, float] = {}
        for part in gathered:
            for key, value in part.items():
                total[key] = total.get(key, 0.0) + value
        return total

    def after_forward(self, model: torch.nn.Module) -> None:
        """FSDP2 keeps the root's parameters gathered after a forward, for a backward that never comes."""
        model.reshard()

    def load_weights(self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))

    def weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        raise RuntimeError("a rank holds slices of the weights: whole weights leave a rank group through "
                           "weight_buckets (RankGroup.weights and RankGroup.publish)")

    def weight_buckets(self, model: torch.nn.Module, bucket_bytes: int) -> tuple[list[Bucket], list[Any]]:
        """The whole weights into the object store, one bucket at a time: every rank gathers the
        bucket's tensors and rank 0 puts the packed bucket, so no rank ever holds the whole model
        beside its shard. Rank 0 returns the layout (a single-process Actor's, tied weights sent
        once) and the buckets' refs; the other ranks return nothing. Every rank must call it."""
        import ray  # the object store is the rank group's way out; the engine itself needs no Ray

        state = model.state_dict()
        layout = [plan_buckets(state, bucket_bytes) if self.rank == 0 else None]
        dist.broadcast_object_list(layout, src=0)  # planned where no shard is empty
        refs = []
        for bucket in layout[0]:
            whole = {spec.name: _whole(state[spec.name]) for spec in bucket}
            if self.rank == 0:
                refs.append(ray.put(pack_flat(whole, bucket).cpu().numpy()))
        return (layout[0], refs) if self.rank == 0 else ([], [])

    def write_checkpoint(self, engine: TrainingEngine, folder: Path, extra_state: dict,
                         extra_files: dict[str, bytes] | None) -> None:
        """Each rank writes its slices; rank 0 then the index, the model's config and tokenizer, the
        trainer state and `extra_files`."""
        model = engine.model
        # a tied weight (lm_head = embeddings) is one parameter with two state-dict names: saved once,
        # under the name named_parameters gives it, on every rank alike
        own_names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
        model_state = [(name, t) for name, t in model.state_dict().items() if name in own_names]
        tensors, shapes = {}, {}
        for prefix, named in (("model/", model_state), ("optim/", _optimizer_tensors(engine))):
            for name, tensor in named:
                key = prefix + name
                shapes[key] = list(tensor.shape)
                if isinstance(tensor, DTensor):
                    tensors[key] = tensor.to_local()
                elif self.rank == 0:  # held whole by every rank: written once
                    tensors[key] = tensor
        write_shard(folder, self.rank, self.world, tensors)
        dist.barrier()
        if self.rank == 0:
            groups = [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups]
            write_index(folder, self.world, shapes, {"param_groups": groups,
                                                     "scheduler": engine.scheduler.state_dict()})
            model.config.save_pretrained(folder)
            engine.tokenizer.save_pretrained(folder)
            (folder / "trainer_state.json").write_text(json.dumps({"step": engine.step, **extra_state}, indent=2))
            for name, content in (extra_files or {}).items():
                (folder / name).write_bytes(content)
        dist.barrier()

    def load_checkpoint(self, engine: TrainingEngine, directory: Path) -> dict:
        """A one-process trainer's checkpoint onto this rank group: its optimizer state is keyed by the
        parameters' order, which is `named_parameters()`'s on both sides."""
        from safetensors.torch import load_file

        saved = torch.load(directory / "optimizer.pt", weights_only=True)
        names = [name for name, _ in engine.model.named_parameters()]
        by_index = saved["optimizer"]["state"]
        optim_state = {name: by_index[i] for i, name in enumerate(names) if i in by_index}
        return restore(engine, directory, load_file(directory / "model.safetensors"), optim_state,
                       saved["optimizer"]["param_groups"], saved["scheduler"])


def _optimizer_tensors(engine: TrainingEngine):
    """(`<parameter name>/<state>`, tensor) of the AdamW state, parameter by parameter."""
    for name, param in engine.model.named_parameters():
        for state, tensor in engine.optimizer.state.get(param, {}).items():
            yield f"{name}/{state}", tensor


def sharded_training_engine(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: TrainConfig,
                            temperature: float, forward: Forward | None = None) -> TrainingEngine:
    """`TrainingEngine` over FSDP2-sharded parameters, on one rank of an initialised process group
    (the one-process engine's arguments)."""
    placement = Fsdp2()
    if config.activation_checkpointing:  # before sharding: the layers keep their checkpoint wrappers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shard_model(model, config)
    # every rank must run the same forwards in lockstep: one per micro-batch, never the prompt-once
    # pair; the base engine's bf16 autocast is replaced by FSDP2's mixed precision (bf16 gathered parameters)
    config = config.model_copy(update={"activation_checkpointing": False, "share_prompts": False,
                                       "param_dtype": "float32"})
    return TrainingEngine(model, tokenizer, config, temperature, forward, placement=placement)
