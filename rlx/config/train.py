"""The `train` section: the trainer's schedule, precision, staleness and recovery budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from rlx.config.base import Section

if TYPE_CHECKING:
    from rlx.config.run import RunConfig


class TrainConfig(Section):
    mode: Literal["colocate", "async"] = "colocate"
    max_staleness: int = Field(0, ge=0, description="0 = strictly on-policy (async mode)")
    steps: int = Field(40, ge=1)
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.99), description="Adam's (beta1, beta2), each in [0, 1)")
    grad_clip: float = Field(1.0, gt=0.0)
    micro_batch_size: int = Field(16, ge=1)
    trainable: list[str] = Field(
        default_factory=list, description="parameter-name patterns (fnmatch) the trainer updates, the rest frozen; "
        "empty: all. e.g. ['model.vision_tower.*', 'model.multi_modal_projector.*'] trains a LLaVA model's vision "
        "side on a frozen language model")
    activation_checkpointing: bool = Field(
        False, description="recompute each layer's activations during backward instead of keeping them: less "
        "memory for about one more forward of compute (R3 routes stay in force for the recomputation)")
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's samples; more than 1 (or mini_batches "
                            "> 1) takes several optimizer updates per step, against old log-probs taken before "
                            "the first, so the clip acts")
    mini_batches: int = Field(1, ge=1, description="optimizer updates per epoch; a sample's mini-batch is a "
                              "seeded function of its uid, never of arrival or length order")
    share_prompts: bool = Field(
        True, description="rows of a micro-batch that share a prompt (a GRPO group) run it once and reuse its KV "
        "cache for their responses, in every trainer-side forward (Actor, ActorFwd, Reference, Teacher): the same "
        "log-probs and gradients up to float rounding, fewer FLOPs. Not applied to media, replayed MoE routes, "
        "activation checkpointing or rank groups (resources.*.ranks > 1)")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="training compute precision. bfloat16: the Actor's and the Critic's forward and "
        "backward run under bf16 autocast, while their weights, gradients and AdamW state stay float32 (rlx keeps "
        "no bf16 parameters). Reference and Teacher load their weights in this dtype; ActorFwd keeps float32 "
        "weights under the same autocast as the Actor, so its proximal log-probs match the Actor's own")
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the gradient reduction across the ranks of a sharded trainer "
        "(resources.actor.ranks > 1). A one-process trainer reduces nothing and accumulates in float32. bfloat16 "
        "is accepted only with param_dtype=bfloat16")
    eval_every: int = Field(10, ge=0, description="0 evaluates only before and after training")
    checkpoint_every: int = Field(0, ge=0, description="0 saves only the final checkpoint")
    time_budget_s: float | None = Field(None, gt=0, description="stop after this much wall time")
    step_timeout_s: float = Field(600.0, gt=0, description="longest wait for one step's samples before failing")
    hang_timeout_s: float = Field(300.0, gt=0, description="a role making no progress this long is hung and "
                                  "gets replaced (async mode)")
    heartbeat_timeout_s: float = Field(15.0, gt=0, description="a replica silent this long is dead: its work "
                                       "is recovered (async mode; replicas beat every second)")
    max_restarts_per_role: int = Field(3, ge=0, description="replacements of one role (a replica lost, hung or "
                                       "whose worker raised; the Actor and Critic from their newest checkpoint) "
                                       "before the run stops")
    max_restarts: int = Field(10, ge=0, description="replacements of all roles together before the run stops")
    seed: int = 0
    check_bus_schema: bool = Field(
        False, description="debug: the bus checks every put against its field's declaration (dtype, shape, scope "
        "in rlx/orchestration/plan.py FIELDS) and a put that does not match fails, naming the field, its writer, "
        "what was expected and what came; costs a pass over every value. The test suite's runs turn it on")

    @property
    def bf16_autocast(self) -> bool:
        """Whether training forwards run under bf16 autocast (param_dtype=bfloat16, float32 master weights)."""
        return self.param_dtype == "bfloat16"


def conflicts(c: RunConfig) -> list[str]:
    if c.train.reduce_dtype == "bfloat16" and c.train.param_dtype == "float32":
        return [("train.reduce_dtype=bfloat16 with train.param_dtype=float32 would reduce gradients below "
                 "the precision they were computed in: set train.reduce_dtype=float32")]
    return []


def lost_actor_cost(c: RunConfig) -> str:
    """What losing the Actor costs (async mode's global recovery, or a crash then `--resume`): the
    steps since its newest checkpoint. `rlx doctor` and an async run's start say it."""
    every, rows = c.train.checkpoint_every, c.rollout.prompts_per_step * c.rollout.n
    if every == 0:
        return ("train.checkpoint_every=0: no checkpoint before the last step, so a lost Actor restarts from the "
                "initial weights and rolls back every step done so far (their samples are counted in "
                "samples_rolled_back, never trained again), and a crashed run resumes from step 0; set "
                "train.checkpoint_every to bound the loss")
    steps = f"{every - 1} step{'' if every == 2 else 's'}"
    return (f"train.checkpoint_every={every}: a lost Actor or a crashed run redoes at most {steps} "
            f"(up to {(every - 1) * rows} samples rolled back)")


def idle_reduce_dtype(c: RunConfig) -> str | None:
    if c.train.reduce_dtype == "bfloat16" and c.resources.actor.ranks == 1:
        return ("train.reduce_dtype=bfloat16 has no effect: the trainer is one process (resources.actor."
                "ranks=1) and accumulates gradients in float32")
    return None


def async_without_checkpoints(c: RunConfig) -> str | None:
    return lost_actor_cost(c) if c.train.mode == "async" and c.train.checkpoint_every == 0 else None
