"""Unit tests for rlx.config: defaults, YAML + dotted overrides, error messages, round trip."""

from __future__ import annotations

import pytest
import yaml

from rlx.config import (
    ClippedLoss,
    ConfigError,
    GspoLoss,
    RunConfig,
    SapoLoss,
    TrainConfig,
    apply_overrides,
    auto_correction,
    build_config,
    config_warnings,
    load_config,
)
from rlx.errors import UserError


def test_defaults_build():
    config = build_config({})
    assert config == RunConfig()
    assert load_config(None) == config
    assert config.train.lr == 1e-5
    assert config.algorithm.advantage == "grpo"
    assert config.algorithm.loss.type == "clipped"
    assert config.algorithm.loss.clip_low == 0.2 and config.algorithm.loss.clip_high == 0.28
    assert config.data.source == "reasoning_gym"
    assert config.rollout.n == 8
    assert str(config.run_dir) == "runs/run"


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, UserError)
    assert issubclass(ConfigError, ValueError)


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "train:\n  lr: 3.0e-5\n  steps: 5\nrollout:\n  n: 4\n  temperature: 0.7\nlogging:\n  name: exp1\n"
    )
    config = load_config(path, ["train.lr=1e-6", "rollout.n=8", 'rollout.stop=["</s>", "\\n\\n"]',
                                "train.betas=[0.8, 0.95]", "data.task_params.min_terms=2"])
    assert config.train.lr == 1e-6 and isinstance(config.train.lr, float)  # override beats the file
    assert config.rollout.n == 8 and isinstance(config.rollout.n, int)
    assert config.train.steps == 5  # file value kept
    assert config.rollout.temperature == 0.7
    assert config.rollout.stop == ["</s>", "\n\n"]
    assert config.train.betas == (0.8, 0.95)
    assert config.data.task_params == {"min_terms": 2}
    assert str(config.run_dir) == "runs/exp1"


def test_apply_overrides_parses_yaml_scalars():
    raw = apply_overrides({}, ["rollout.n=8", "train.lr=0.5", "logging.progress_bar=false", "rollout.stop=[a, b]",
                               "logging.name=my run", "model.path="])
    assert raw["rollout"]["n"] == 8 and isinstance(raw["rollout"]["n"], int)
    assert raw["train"]["lr"] == 0.5 and isinstance(raw["train"]["lr"], float)
    assert raw["logging"]["progress_bar"] is False
    assert raw["rollout"]["stop"] == ["a", "b"]
    assert raw["logging"]["name"] == "my run"
    assert raw["model"]["path"] == ""


def test_exponent_floats_in_free_form_task_params_are_floats():
    # `1e-3` is a float to any user (and in YAML 1.2); typed fields get coerced by pydantic, but
    # data.task_params is dict[str, Any], so whatever apply_overrides produced reaches reasoning-gym as is.
    config = load_config(None, ["data.task_params.min_value=1e-3", "train.lr=2e-6"])
    assert config.train.lr == 2e-6
    assert isinstance(config.data.task_params["min_value"], float), config.data.task_params


def test_override_errors():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["train.lr"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["=3"])
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides({"train": 5}, ["train.lr=1"])


@pytest.mark.parametrize(
    "override,key,suggestion",
    [
        ("trian.lr=1e-6", "'trian'", "'train'"),
        ("train.lrr=1e-6", "'train.lrr'", "'train.lr'"),
        ("rollout.temprature=0.5", "'rollout.temprature'", "'rollout.temperature'"),
    ],
)
def test_unknown_key_names_key_and_suggests(override, key, suggestion):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert f"unknown key {key}" in message
    assert f"Did you mean {suggestion}?" in message
    assert "Allowed here:" in message


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  kl_cof: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "algorithm.kl_cof" in str(info.value)
    assert "'algorithm.kl_coef'" in str(info.value)


@pytest.mark.parametrize(
    "override,fragments",
    [
        ("train.lr=-1", ["train.lr", "-1", "greater than 0"]),
        ("rollout.top_p=1.5", ["rollout.top_p", "1.5", "less than or equal to 1"]),
        ("rollout.n=0", ["rollout.n", "0", "greater than or equal to 1"]),
        ("algorithm.kl_type=k7", ["algorithm.kl_type", "k7", "k1"]),
    ],
)
def test_bad_value_names_key_value_and_bound(override, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_several_errors_are_all_reported():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.lr=-1", "rollout.top_p=1.5"])
    assert "train.lr" in str(info.value) and "rollout.top_p" in str(info.value)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(missing)
    assert "nope.yaml" in str(info.value)


def test_invalid_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


def test_empty_yaml_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == RunConfig()


@pytest.mark.parametrize("source", ["jsonl", "parquet"])
def test_file_source_needs_path(source):
    with pytest.raises(ConfigError, match="data.path"):
        load_config(None, [f"data.source={source}"])
    config = load_config(None, [f"data.source={source}", "data.path=train.jsonl"])
    assert config.data.path == "train.jsonl"


def test_assignment_is_validated():
    config = RunConfig()
    with pytest.raises(ValueError):
        config.train.lr = -1.0


def test_to_yaml_round_trip():
    config = load_config(None, [
        "train.lr=2.5e-6", "train.steps=7", "train.betas=[0.8, 0.9]", "train.time_budget_s=12.5",
        "rollout.stop=['</s>', 'END']", "rollout.top_k=5", "algorithm.kl_coef=0.05", "algorithm.kl_type=k2",
        "data.source=jsonl", "data.path=/tmp/x.jsonl", "data.task_params={a: 1, b: [1, 2]}",
        "logging.name=round", "resources.num_threads=2",
    ])
    text = config.to_yaml()
    again = build_config(yaml.safe_load(text))
    assert again == config
    assert again.to_yaml() == text
    assert RunConfig() == build_config(yaml.safe_load(RunConfig().to_yaml()))


@pytest.mark.parametrize("raw,fix", [
    ({"algorithm": {"advantage": "none"}}, "teacher.path"),
    ({"rollout": {"n": 1}}, "rollout.n>=2"),
    ({"algorithm": {"dynamic_sampling": True, "advantage": "reinforce_pp"}}, "group-relative"),
    ({"algorithm": {"advantage": "grpo"}, "critic": {"path": "x"}}, "algorithm.advantage=gae"),
    ({"algorithm": {"advantage": "gae", "loss": {"type": "gspo"}}}, "algorithm.loss.type=clipped"),
    ({"algorithm": {"loss": {"type": "gspo"}}}, "aggregation=seq-mean-token-mean"),
    ({"train": {"reduce_dtype": "bfloat16"}}, "set train.reduce_dtype=float32"),
    ({"reward": {"scope": "group"}}, "reward.scope=sample"),
    ({"algorithm": {"kl_reference_refresh_every": 4}}, "set kl_coef>0"),
    ({"rollout": {"autoscale": {"enabled": True}}}, "set train.mode=async"),
    ({"rollout": {"autoscale": {"min_replicas": 3}}}, "raise max_replicas"),
    ({"rollout": {"autoscale": {"scale_up_below": 0.8}}}, "scale both ways at once"),
    ({"train": {"mode": "async"}, "resources": {"actor": {"replicas": 2}}}, "resources.actor.replicas=2"),
    ({"resources": {"reward": {"replicas": 2}}}, "resources.reward.replicas > 1 needs separate services"),
    ({"train": {"mode": "async"}, "rollout": {"autoscale": {"enabled": True, "max_replicas": 2}},
      "resources": {"rollout": {"replicas": 3}}}, "outside rollout.autoscale's range 1..2"),
])
def test_algorithm_and_reward_choices_are_checked_together(raw, fix):
    with pytest.raises(ConfigError) as error:
        build_config(raw)
    assert fix in str(error.value)


def test_every_conflict_is_reported_at_once():
    with pytest.raises(ConfigError) as error:
        build_config({"algorithm": {"advantage": "none"}, "reward": {"scope": "group"}})
    assert "teacher.path" in str(error.value) and "reward.scope" in str(error.value)


def test_ppo_and_distillation_configs_pick_their_roles():
    ppo = build_config({"algorithm": {"advantage": "gae"}, "rollout": {"n": 1}})
    assert ppo.uses_critic and not ppo.uses_teacher and not ppo.filters_zero_std_groups
    distill = build_config({"algorithm": {"advantage": "none"}, "teacher": {"path": "some/teacher"}})
    assert distill.uses_teacher and not distill.filters_zero_std_groups


def test_the_rollout_starts_within_the_autoscalers_range():
    scaled = {"train": {"mode": "async"}, "rollout": {"autoscale": {"enabled": True, "min_replicas": 2,
                                                                    "max_replicas": 3}}}
    assert build_config(scaled).initial_rollout_replicas == 2  # the default of 1 is brought into range
    assert build_config({**scaled, "resources": {"rollout": {"replicas": 3}}}).initial_rollout_replicas == 3
    assert build_config({"train": {"mode": "async"}, "resources": {"rollout": {"replicas": 4}}}
                        ).initial_rollout_replicas == 4


# ------------------------------------------------------------------------------- loss sections


def test_each_loss_has_its_own_section_chosen_by_type():
    gspo = load_config(None, ["algorithm.loss.type=gspo", "algorithm.aggregation=seq-mean-token-mean"])
    assert isinstance(gspo.algorithm.loss, GspoLoss)
    assert (gspo.algorithm.loss.clip_low, gspo.algorithm.loss.clip_high) == (3e-4, 4e-4)  # GSPO's own defaults
    sapo = load_config(None, ["algorithm.loss={type: sapo, tau_neg: 2.0}"])
    assert isinstance(sapo.algorithm.loss, SapoLoss) and sapo.algorithm.loss.tau_neg == 2.0
    # a section without `type` tunes the default clipped loss
    clipped = load_config(None, ["algorithm.loss.clip_high=0.2", "algorithm.loss.dual_clip=3"])
    assert clipped.algorithm.loss == ClippedLoss(clip_high=0.2, dual_clip=3.0)
    assert build_config(yaml.safe_load(sapo.to_yaml())) == sapo


@pytest.mark.parametrize("override,message", [
    ("algorithm.policy_loss=gspo", "algorithm.policy_loss moved to algorithm.loss.type"),
    ("algorithm.clip_high=0.2",
     "algorithm.clip_high moved to algorithm.loss.clip_high (with algorithm.loss.type=clipped, the default)"),
    ("algorithm.dual_clip=3", "algorithm.dual_clip moved to algorithm.loss.dual_clip"),
    ("algorithm.gspo_clip_low=0.1",
     "algorithm.gspo_clip_low moved to algorithm.loss.clip_low (with algorithm.loss.type=gspo)"),
    ("algorithm.sapo_tau_neg=2",
     "algorithm.sapo_tau_neg moved to algorithm.loss.tau_neg (with algorithm.loss.type=sapo)"),
    ("algorithm.cispo_clip_high=0.3",
     "algorithm.cispo_clip_high moved to algorithm.loss.clip_high (with algorithm.loss.type=cispo)"),
    ("model.dtype=bfloat16", "model.dtype moved to rollout.dtype (generation) and train.param_dtype"),
    ("train.autocast_bf16=true", "train.autocast_bf16 moved to train.param_dtype"),
])
def test_moved_keys_name_their_new_place(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert message in str(error.value)


@pytest.mark.parametrize("override,fragments", [
    ("algorithm.loss.tau_pos=2", ["unknown key 'algorithm.loss.tau_pos'", "a key of algorithm.loss.type=sapo",
                                  "Allowed here: type, clip_low, clip_high, dual_clip"]),
    ("algorithm.loss.clip_hi=0.3", ["Did you mean 'algorithm.loss.clip_high'?"]),
    ("algorithm.loss.clip_low=2", ["algorithm.loss.clip_low = 2", "less than or equal to 1"]),
    ("algorithm.loss.type=ppo", ["algorithm.loss.type='ppo' is not one of clipped, gspo, sapo, cispo, custom",
                                 "algorithm.loss.type=custom algorithm.loss.name=module:name"]),
])
def test_bad_loss_keys_are_named_as_users_write_them(override, fragments):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))


# ---------------------------------------------------------------------- precision and correction


@pytest.mark.parametrize("raw,expected", [
    ({}, "none"),
    ({"train": {"mode": "async", "max_staleness": 1}}, "decoupled"),
    ({"train": {"mode": "async", "max_staleness": 2}, "rollout": {"engine": "vllm"}}, "decoupled"),
    ({"train": {"mode": "colocate", "max_staleness": 2}}, "none"),  # colocated steps train on current weights
    ({"train": {"mode": "async"}}, "none"),
    ({"rollout": {"engine": "vllm"}}, "tis"),
    ({"rollout": {"engine": "sglang"}}, "tis"),
    ({"rollout": {"dtype": "bfloat16"}}, "tis"),
    ({"train": {"param_dtype": "bfloat16"}}, "tis"),
    ({"rollout": {"dtype": "bfloat16"}, "train": {"param_dtype": "bfloat16"}}, "none"),
    ({"reward": {"judge": {"dtype": "bfloat16"}}}, "none"),  # the judge's dtype is not the behaviour policy's
    ({"algorithm": {"behavior_correction": "none"}, "train": {"mode": "async", "max_staleness": 2}}, "none"),
    ({"algorithm": {"behavior_correction": "tis"}}, "tis"),
    ({"algorithm": {"behavior_correction": "decoupled"}}, "decoupled"),
])
def test_auto_behavior_correction_resolution_table(raw, expected):
    config = build_config(raw)
    assert config.algorithm.resolved_correction == expected
    assert auto_correction(config)[0] == expected
    assert config.algorithm.behavior_correction == raw.get("algorithm", {}).get("behavior_correction", "auto")
    # the YAML keeps what was asked for, and resolves the same way when read back
    again = build_config(yaml.safe_load(config.to_yaml()))
    assert again.algorithm.behavior_correction == config.algorithm.behavior_correction
    assert again.algorithm.resolved_correction == expected


def test_the_actor_fwd_role_follows_the_resolved_correction():
    from rlx.orchestration.plan import _uses_actor_fwd

    assert _uses_actor_fwd(build_config({"train": {"mode": "async", "max_staleness": 1}}))
    assert not _uses_actor_fwd(build_config({"train": {"mode": "async", "max_staleness": 1},
                                             "algorithm": {"behavior_correction": "tis"}}))


def test_precision_keys_and_warnings():
    config = build_config({"train": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}})
    assert config.train.bf16_autocast and not TrainConfig().bf16_autocast
    assert config_warnings(config) == [
        ("train.reduce_dtype=bfloat16 has no effect: the trainer is one process (resources.actor.ranks=1) "
        "and accumulates gradients in float32")]
    assert config_warnings(RunConfig()) == []
    stale = build_config({"train": {"mode": "async", "max_staleness": 3}, "algorithm": {"behavior_correction": "none"}})
    assert "algorithm.behavior_correction=none with train.max_staleness=3" in config_warnings(stale)[0]
    judged = build_config({"rollout": {"engine": "sglang"}, "reward": {"name": "genrm"}})
    assert "reward.judge.engine=hf, not the policy's rollout.engine=sglang" in config_warnings(judged)[0]
    on_gpus = build_config({"train": {"mode": "async", "max_staleness": 2}, "resources": {"actor": {"num_gpus": 1}}})
    assert "resources.actor_fwd.num_gpus=0 while the Actor has GPUs" in config_warnings(on_gpus)[0]
    assert "resolved to decoupled" in on_gpus.to_yaml().splitlines()[0]  # the run directory records it


@pytest.mark.parametrize("overrides,lines", [
    (["train.mode=async", "train.max_staleness=2", "algorithm.behavior_correction=none"],
     ["# algorithm.behavior_correction=none -> none (set explicitly)",
      "# warning: algorithm.behavior_correction=none with train.max_staleness=2"]),
    (["rollout.dtype=bfloat16"],
     ["# algorithm.behavior_correction=auto -> tis",
      "(rollout.dtype=bfloat16 differs from the trainer's train.param_dtype=float32)"]),
    (["train.mode=async", "train.max_staleness=1", "train.checkpoint_every=10"],
     ["# algorithm.behavior_correction=auto -> decoupled",
      "(train.max_staleness=1: samples may come from older weights)",
      "# recovery: train.checkpoint_every=10: a lost Actor or a crashed run redoes at most 9 steps"]),
    # an async run that never checkpoints before its end: a lost Actor costs every step so far
    (["train.mode=async"],
     [("# warning: train.checkpoint_every=0: no checkpoint before the last step, so a lost Actor restarts from "
       "the initial weights")]),
])
def test_doctor_prints_the_resolved_correction_and_warnings(overrides, lines, capsys):
    from rlx.cli import main

    assert main(["doctor", *overrides]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["algorithm"]["behavior_correction"] in ("auto", "none")
    for line in lines:
        assert line in err, (line, err)
    assert err.rstrip().endswith("# config OK")
    assert ("# warning:" in err) == any("warning" in line for line in lines)


@pytest.mark.parametrize("raw, expected", [
    ({}, "off"),  # the dense default model
    ({"model": {"path": "tiny-moe"}}, "r3"),
    ({"model": {"path": "tiny-moe"}, "rollout": {"engine": "vllm"}}, "r3"),
    ({"model": {"path": "tiny-moe"}, "rollout": {"engine": "sglang", "engine_options": {"url": "http://127.0.0.1:1"}}},
     "r3"),
    # rlx's vllm URL adapter reports no routes
    ({"model": {"path": "tiny-moe"}, "rollout": {"engine": "vllm", "engine_options": {"url": "http://127.0.0.1:1"}}},
     "off"),
    ({"model": {"path": "tiny-moe"}, "algorithm": {"routing_replay": "off"}}, "off"),
])
def test_routing_replay_resolution(raw, expected):
    from rlx.config import resolve_routing_replay

    config = build_config(raw)
    assert config.routing_replay == expected == resolve_routing_replay(config)[0]
    assert f"routing_replay resolved to {expected}" in config.to_yaml()


def test_moe_settings_on_a_dense_model_name_the_fix(tmp_path):
    with pytest.raises(UserError, match=r"routing_replay=r3 replays mixture-of-experts routes, but model\.path="
                                              r"'smollm2-135m-instruct' is a dense model"):
        build_config({"algorithm": {"routing_replay": "r3"}})
    with pytest.raises(UserError, match="set algorithm.router_aux_loss_coef=0"):
        build_config({"algorithm": {"router_aux_loss_coef": 0.01}})
    from rlx.generation_engines import GENERATION_ENGINES

    GENERATION_ENGINES.register("no-routes")(lambda spec: None)
    try:
        with pytest.raises(UserError, match="rollout.engine=no-routes does not report them"):
            build_config({"model": {"path": "tiny-moe"}, "rollout": {"engine": "no-routes"},
                          "algorithm": {"routing_replay": "r3"}})
        assert build_config({"model": {"path": "tiny-moe"}, "rollout": {"engine": "no-routes"}}).routing_replay == "off"
        with pytest.raises(UserError, match=r"rollout.engine=vllm by URL \(engine_options.url\) does not report them"):
            build_config({"model": {"path": "tiny-moe"}, "algorithm": {"routing_replay": "r3"},
                          "rollout": {"engine": "vllm", "engine_options": {"url": "http://127.0.0.1:1"}}})
    finally:
        GENERATION_ENGINES._entries.pop("no-routes")


def test_ranks_are_for_model_holding_roles_and_trainers_take_one_update_per_step():
    assert build_config({"resources": {"actor": {"ranks": 2}, "critic": {"ranks": 2}}}).resources.actor.ranks == 2
    sharded_forwards = build_config({"resources": {"reference": {"ranks": 2}, "teacher": {"ranks": 3},
                                                   "actor_fwd": {"ranks": 2}},
                                     "train": {"ppo_epochs": 2}})  # forward-only roles take no update
    forwards = sharded_forwards.resources
    assert (forwards.reference.ranks, forwards.teacher.ranks, forwards.actor_fwd.ranks) == (2, 3, 2)
    with pytest.raises(ConfigError, match=r"resources.rollout.ranks=2: only the actor, critic, reference, teacher, "
                                          r"actor_fwd shard"):
        build_config({"resources": {"rollout": {"ranks": 2}}})
    with pytest.raises(ConfigError, match=r"resources.actor.ranks > 1 with train.ppo_epochs=2"):
        build_config({"resources": {"actor": {"ranks": 2}}, "train": {"ppo_epochs": 2}})


def test_media_rows_take_an_agent_environment_but_not_an_agent_app():
    media = ["data.source=digits"]
    load_config(None, [*media, "rollout.agent={environment: tools, tools: [{name: calculator}]}"])
    with pytest.raises(ConfigError, match="an agent app's calls carry text only: unset rollout.agent_app"):
        load_config(None, [*media, "rollout.agent_app=tests.integration.agent_apps:toy_chat",
                           "reward.name=environment"])


def _config_modules():
    import importlib
    import pkgutil
    from pathlib import Path

    import rlx.config

    folder = Path(rlx.config.__file__).parent
    return folder, [importlib.import_module(f"rlx.config.{m.name}") for m in pkgutil.iter_modules([str(folder)])]


def test_config_modules_stay_small():
    folder, _ = _config_modules()
    sizes = {path.name: len(path.read_text().splitlines()) for path in folder.glob("*.py")}
    assert {name: lines for name, lines in sizes.items() if lines > 400} == {}, "split the section's module"


def test_every_sections_rules_are_collected():
    """A rule beside its section counts only once `run.py` lists it: one left out would never fire."""
    import inspect

    from rlx.config.run import CONFLICTS, WARNINGS

    _, modules = _config_modules()
    conflicts = [m.conflicts for m in modules if hasattr(m, "conflicts")]
    warnings = [f for m in modules for name, f in inspect.getmembers(m, inspect.isfunction)
                if f.__module__ == m.__name__ and not name.startswith("_")
                and inspect.signature(f).return_annotation == "str | None"]
    assert sorted(f.__qualname__ + f.__module__ for f in conflicts) == sorted(
        f.__qualname__ + f.__module__ for f in CONFLICTS), "list each module's conflicts in run.CONFLICTS"
    assert set(warnings) == set(WARNINGS) and len(WARNINGS) == len(set(WARNINGS)), "list each warning in run.WARNINGS"
