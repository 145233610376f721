"""The forward-only roles on one rank of a group: a Reference, Teacher or ActorFwd whose weights
are sharded like a trainer's (`rlx.engines.training.fsdp`), every forward run in lockstep, and new
weights (a Reference that follows the policy, each ActorFwd version) loaded whole and kept as this
rank's slices. They are the one-process roles with the `Fsdp2` placement; the caller shards the
model first (`shard_model`, here beside them for that). Imported only on a rank: it imports FSDP2.
"""

from __future__ import annotations

from rlx.engines.training.fsdp import Fsdp2, shard_model
from rlx.roles.reference import ActorFwd, Reference


def ShardedReference(model, pad_token_id: int, temperature: float, micro_batch_size: int,
                     refresh_every: int = 0, bf16: bool = False, share_prompts: bool = False) -> Reference:
    """A Reference (or Teacher) on this rank; the arguments are `Reference`'s."""
    return Reference(model, pad_token_id, temperature, micro_batch_size, refresh_every, bf16, share_prompts,
                     placement=Fsdp2())


def ShardedActorFwd(model, pad_token_id: int, temperature: float, micro_batch_size: int,
                    refresh_every: int = 0, bf16: bool = False, share_prompts: bool = False) -> ActorFwd:
    """ActorFwd on this rank; the arguments are `ActorFwd`'s."""
    return ActorFwd(model, pad_token_id, temperature, micro_batch_size, refresh_every, bf16, share_prompts,
                    placement=Fsdp2())


__all__ = ["ShardedActorFwd", "ShardedReference", "shard_model"]
