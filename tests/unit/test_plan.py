"""The role plan: hand-checked roles and bus fields for each algorithm family."""

from __future__ import annotations

import dataclasses

import pytest

from rlx.algorithms.losses import BUS_INPUTS, LossInputs
from rlx.config import ConfigError, build_config
from rlx.data.sample import Sample
from rlx.orchestration.plan import FIELDS, ROLES, FieldSpec, build_plan
from rlx.orchestration.workers import to_samples

ROLLOUT_WRITES = {"group_id", "prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", "agent_stats", "behavior_version",
                  "last_behavior_version", "finish_reason", "response_text", "prompt_text", "label", "metadata"}
TOKENS = {"group_id", "prompt_ids", "response_ids"}
TRAIN_BASE = {"group_id", "prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", "agent_stats", "behavior_version",
              "last_behavior_version", "finish_reason", "reward", "reward_error", "advantage", "token_advantages",
              "filter_reason"}
ADVANTAGES_BASE = {"group_id", "response_ids", "rollout_logprobs", "loss_mask", "reward", "reward_error"}
ADVANTAGES_WRITES = {"advantage", "token_advantages", "returns", "filter_reason"}


def plan_of(**sections):
    return build_plan(build_config(sections))


def test_grpo_runs_rollout_reward_advantages_and_actor():
    plan = plan_of()
    assert plan.role_names == ["actor", "reward", "advantages", "rollout"]
    assert set(plan.outputs("rollout")) == ROLLOUT_WRITES
    assert set(plan.inputs("reward")) == {"group_id", "response_ids", "response_text", "prompt_text", "label",
                                          "metadata"}
    assert set(plan.outputs("reward")) == {"reward", "reward_error"}
    assert set(plan.inputs("advantages")) == ADVANTAGES_BASE
    assert set(plan.outputs("advantages")) == ADVANTAGES_WRITES
    assert set(plan.inputs("train")) == TRAIN_BASE
    assert plan.final_tasks == ["train"]
    assert plan.phase_order == ["reward", "advantages", "train"]
    assert plan.stateful_roles == {"actor"}
    assert plan.unfinished_work == {"actor": [("train", None)], "reward": [("reward", "reward")],
                                    "advantages": [("advantages", "advantage")]}


def test_kl_adds_a_reference_that_skips_filtered_samples():
    plan = plan_of(algorithm={"kl_coef": 0.05})
    assert plan.role_names == ["actor", "reward", "advantages", "reference", "rollout"]
    assert set(plan.inputs("reference")) == TOKENS | {"filter_reason"}  # after advantages: skips filtered rows
    assert plan.outputs("reference") == ["ref_logprobs"]
    assert set(plan.inputs("train")) == TRAIN_BASE | {"ref_logprobs"}
    assert plan.phase_order == ["reward", "advantages", "reference", "train"]


def test_ppo_adds_a_critic_with_two_tasks():
    plan = plan_of(algorithm={"advantage": "gae"}, rollout={"n": 1})
    assert plan.role_names == ["actor", "reward", "advantages", "critic", "rollout"]
    assert set(plan.inputs("critic")) == TOKENS
    assert plan.outputs("critic") == ["values"]
    assert set(plan.inputs("advantages")) == ADVANTAGES_BASE | {"values"}
    assert set(plan.inputs("critic_train")) == TOKENS | {"loss_mask", "values", "returns", "filter_reason"}
    assert plan.final_tasks == ["train", "critic_train"]
    assert plan.phase_order == ["reward", "critic", "advantages", "train", "critic_train"]
    assert plan.stateful_roles == {"actor", "critic"}
    assert plan.unfinished_work["critic"] == [("critic", "values"), ("critic_train", None)]


def test_on_policy_distillation_adds_a_teacher_before_advantages():
    plan = plan_of(algorithm={"advantage": "none"}, teacher={"path": "tiny-char"})
    assert plan.role_names == ["actor", "reward", "advantages", "teacher", "rollout"]
    assert set(plan.inputs("teacher")) == TOKENS
    assert set(plan.inputs("advantages")) == ADVANTAGES_BASE | {"teacher_logprobs"}
    assert set(plan.inputs("train")) == TRAIN_BASE | {"teacher_logprobs"}
    assert plan.phase_order == ["reward", "teacher", "advantages", "train"]


def test_genrm_takes_the_reward_task():
    plan = plan_of(reward={"name": "genrm"})
    assert plan.role_names == ["actor", "genrm", "advantages", "rollout"]
    assert plan.tasks["reward"] == "genrm"
    assert plan.unfinished_work["genrm"] == [("reward", "reward")]


def test_decoupled_ppo_adds_actor_fwd_in_async_mode_only():
    sections = {"algorithm": {"behavior_correction": "decoupled"}, "train": {"mode": "async", "max_staleness": 2}}
    plan = plan_of(**sections)
    assert plan.role_names == ["actor", "reward", "advantages", "actor_fwd", "rollout"]
    assert set(plan.inputs("actor_fwd")) == TOKENS  # starts as soon as a sample exists
    assert plan.outputs("actor_fwd") == ["old_logprobs", "proximal_version"]
    assert set(plan.inputs("train")) == TRAIN_BASE | {"old_logprobs", "proximal_version"}
    colocated = plan_of(algorithm={"behavior_correction": "decoupled"})
    assert not colocated.has("actor_fwd")


def test_routing_replay_carries_routes_to_every_trainer_side_forward():
    plan = plan_of(model={"path": "tiny-moe"}, algorithm={"kl_coef": 0.1}, train={"mode": "async", "max_staleness": 1})
    assert set(plan.outputs("rollout")) == ROLLOUT_WRITES | {"routed_experts"}
    for task in ("reference", "actor_fwd", "train"):
        assert "routed_experts" in plan.inputs(task), task
    assert "routed_experts" not in plan.inputs("reward") + plan.inputs("advantages")
    assert "routed_experts" not in plan_of(model={"path": "tiny-moe"}, algorithm={"routing_replay": "off"}).outputs(
        "rollout")


def test_a_needed_field_without_a_writer_names_the_reader_the_field_and_the_writer():
    without_reference = tuple(role for role in ROLES if role.name != "reference")
    with pytest.raises(ConfigError, match="'train' needs field 'ref_logprobs'.*'reference'"):
        build_plan(build_config({"algorithm": {"kl_coef": 0.1}}), roles=without_reference)


def test_a_cycle_of_reads_is_a_config_error():
    echo = FieldSpec("echo", "advantages", ("reward",), "float32")  # reward would wait on advantages, which wait on it
    with pytest.raises(ConfigError, match="cycle"):
        build_plan(build_config({}), fields=(*FIELDS, echo))


def test_the_done_field_is_marked_not_taken_from_declaration_order():
    plan = plan_of(train={"mode": "async", "max_staleness": 1})  # auto: decoupled, so ActorFwd runs
    assert plan.primary_output("actor_fwd") == "old_logprobs"
    reordered = tuple(sorted(FIELDS, key=lambda f: f.name != "proximal_version"))  # proximal_version first
    assert build_plan(build_config({"train": {"mode": "async", "max_staleness": 1}}),
                      fields=reordered).task_outputs["actor_fwd"] == "old_logprobs"
    unmarked = tuple(FieldSpec(f.name, f.writer, f.readers, f.dtype, f.shape) if f.name == "reward" else f
                     for f in FIELDS)
    with pytest.raises(ConfigError, match="'reward' must mark exactly one field"):
        build_plan(build_config({}), fields=unmarked)


def test_every_field_has_a_schema_and_token_fields_say_so():
    by_name = {f.name: f for f in FIELDS}
    assert by_name["loss_mask"].token_aligned and by_name["ref_logprobs"].token_aligned
    assert not by_name["reward"].token_aligned and by_name["prompt_ids"].shape == ("P",)
    assert [f.name for f in FIELDS if f.scope == "group"] == ["media_inputs"]  # one per prompt group
    assert len(by_name) == len(FIELDS)  # each field declared once


def test_fields_and_sample_declare_the_same_names():
    # a bus field is one FieldSpec and one Sample attribute of the same name (uid is the row id)
    assert {f.name for f in FIELDS} == {f.name for f in dataclasses.fields(Sample)} - {"uid"}


def test_a_bus_field_sample_lacks_is_an_error_not_dropped():
    assert to_samples([4], {"group_id": [0], "reward": [1.0]})[0].reward == 1.0
    with pytest.raises(ValueError, match=r"bus fields \['rewrd'\] have no attribute on Sample"):
        to_samples([4], {"group_id": [0], "reward": [1.0], "rewrd": [2.0]})


def test_the_loss_inputs_from_the_bus_are_per_token_fields_the_train_task_reads():
    by_name = {f.name: f for f in FIELDS}
    for name in BUS_INPUTS:
        assert by_name[name].token_aligned and "train" in by_name[name].readers, name
        assert name in {f.name for f in dataclasses.fields(LossInputs)}


def test_media_rows_add_one_group_scoped_field_read_by_every_token_role():
    plan = plan_of(data={"source": "digits"}, reward={"name": "exact_match"}, algorithm={"kl_coef": 0.1})
    assert plan.group_scoped == {"media_inputs"}
    assert "media_inputs" in plan.outputs("rollout")
    assert all("media_inputs" in plan.inputs(task) for task in ("reference", "train"))
    assert "media_inputs" not in plan.inputs("reward") + plan.inputs("advantages")
    assert "media_inputs" not in plan_of().outputs("rollout") and plan_of().group_scoped == frozenset()


def test_media_rows_need_the_hf_engine_and_a_single_turn_rollout():
    with pytest.raises(ConfigError, match="rollout.engine=hf"):
        build_config({"data": {"source": "digits"}, "reward": {"name": "exact_match"}, "rollout": {"engine": "vllm"}})
