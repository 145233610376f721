"""The `resources` section: Ray's cluster and each role's CPUs, GPUs, threads, replicas and ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from rlx.config.base import Section

if TYPE_CHECKING:
    from rlx.config.run import RunConfig

SHARDABLE_ROLES = ("actor", "critic", "reference", "teacher", "actor_fwd")
TRAINERS = ("actor", "critic")  # roles holding optimizer state


class RoleResources(Section):
    num_cpus: float = Field(0.5, ge=0.0, description="Ray logical CPUs reserved for the role's replica")
    num_gpus: float = Field(0.0, ge=0.0)
    threads: int = Field(1, ge=1, description="torch intra-op threads inside the replica")
    replicas: int = Field(1, ge=1, le=16, description="replicas of the role (async mode). A stateless role with 2 "
                          "or more keeps serving while a lost one is replaced; the Rollout starts with this "
                          "many (`rlx scale` changes it); the Actor and the Critic have exactly one")
    ranks: int = Field(1, ge=1, le=64, description="processes that hold the role's model together, its parameters "
                       "(and a trainer's gradients and optimizer state) sharded over them (FSDP2; gloo on CPU, nccl "
                       "with GPUs). Actor, Critic, Reference, Teacher and ActorFwd; each rank reserves num_cpus and num_gpus")


class ResourcesConfig(Section):
    device: Literal["cpu", "cuda"] = "cpu"
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; default: all cores")
    ray_address: str | None = Field(None, description="join this Ray cluster instead of starting a local one")
    ray_allow_unauthenticated: bool = Field(False, description="join a ray_address cluster that accepts clients "
                                            "without Ray's auth token, or run on a Ray before 2.60 (whose Serve "
                                            "replicas take unauthenticated calls): anyone who reaches it can run code "
                                            "in the run")
    ray_num_cpus: float = Field(8.0, gt=0, description="logical CPUs of a local Ray cluster")
    rollout: RoleResources = Field(default_factory=RoleResources)
    actor: RoleResources = Field(default_factory=RoleResources)
    reward: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=0.1))
    advantages: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=0.1))
    reference: RoleResources = Field(default_factory=RoleResources)
    actor_fwd: RoleResources = Field(default_factory=RoleResources)
    critic: RoleResources = Field(default_factory=RoleResources)
    teacher: RoleResources = Field(default_factory=RoleResources)
    genrm: RoleResources = Field(default_factory=RoleResources)


def conflicts(c: RunConfig) -> list[str]:
    """Replicas and ranks each role can have in the run's mode."""
    problems = []
    replicas = {role: value.replicas for role, value in c.resources if isinstance(value, RoleResources)}
    for role in TRAINERS:
        if replicas[role] != 1:
            problems.append(f"resources.{role}.replicas={replicas[role]}: the {role} holds its optimizer state in "
                            "one replica; set it to 1")
    replicated = [role for role, count in replicas.items() if count > 1]
    if replicated and c.train.mode != "async":
        problems.append(f"resources.{replicated[0]}.replicas > 1 needs separate services, which exist in async mode "
                        "only: set train.mode=async, or replicas=1")
    scale, explicit = c.rollout.autoscale, "replicas" in c.resources.rollout.model_fields_set
    if scale.enabled and explicit and not scale.min_replicas <= c.resources.rollout.replicas <= scale.max_replicas:
        problems.append(f"resources.rollout.replicas={c.resources.rollout.replicas} is outside rollout.autoscale's "
                        f"range {scale.min_replicas}..{scale.max_replicas}: start within it")
    ranked = [role for role, value in c.resources if isinstance(value, RoleResources) and value.ranks > 1]
    for role in ranked:
        if role not in SHARDABLE_ROLES:
            problems.append(f"resources.{role}.ranks={getattr(c.resources, role).ranks}: only the "
                            f"{', '.join(SHARDABLE_ROLES)} shard over ranks; set it to 1")
    trainers = [role for role in ranked if role in TRAINERS]
    if trainers and (c.train.ppo_epochs > 1 or c.train.mini_batches > 1):
        problems.append(f"resources.{trainers[0]}.ranks > 1 with train.ppo_epochs={c.train.ppo_epochs} and "
                        f"train.mini_batches={c.train.mini_batches}: a sharded trainer takes one update per step "
                        "for now; set both to 1, or ranks=1")
    return problems


def actor_fwd_without_gpus(c: RunConfig) -> str | None:
    res = c.resources
    if (c.train.mode == "async" and c.algorithm.resolved_correction == "decoupled" and res.actor.num_gpus > 0
            and res.actor_fwd.num_gpus == 0):
        return ("decoupled PPO runs an ActorFwd service with a copy of the policy, and "
                "resources.actor_fwd.num_gpus=0 while the Actor has GPUs: give it resources.actor_fwd.num_gpus")
    return None
