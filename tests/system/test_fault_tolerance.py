"""Fault injection in async mode: killed and hung stateless roles are replaced, their unfinished
work goes back to the bus or the prompt source, and no sample is lost or trained twice.

The faults are injected on purpose (`faults` in the config): a replica's process exits, or its
worker loop blocks without a heartbeat. Everything else is the real run."""

from __future__ import annotations

import json

from rlx.config import FaultConfig
from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from tests.integration.test_colocate_loop import toy_config


def test_killed_and_hung_roles_recover_and_nothing_is_lost(tiny_path, tmp_path):
    # the trainer cannot outrun a dead producer by more than max_staleness steps, so every fault must be
    # recovered for the run to reach its last step
    config = toy_config(tiny_path, tmp_path, train__steps=30, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2, train__hang_timeout_s=6, train__step_timeout_s=300,
                        train__heartbeat_timeout_s=10)
    config.faults = [FaultConfig(role="reward", at_step=2, kind="kill"),
                     FaultConfig(role="rollout", at_step=4, kind="kill"),
                     FaultConfig(role="advantages", at_step=6, kind="hang")]
    run_dir = run_async(config, echo=print)

    steps = [r for r in read_metrics(run_dir) if "trained_samples" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))  # the run completed
    assert steps[-1]["total_samples_duplicated"] == 0  # no sample reached the trainer twice
    for r in steps:  # every row of every step is accounted for: trained or filtered with a reason
        assert r["trained_samples"] + sum(v for k, v in r.items() if k.startswith("filtered_")) == 16

    health = json.loads((run_dir / "health.json").read_text())
    recovered = {r["role"]: r for r in health["recoveries"]}
    assert set(recovered) == {"reward", "rollout", "advantages"}, health
    for recovery in recovered.values():  # each role was noticed dead and served again by a new replica
        assert recovery["detected_after_s"] is not None and recovery["replaced_after_s"] is not None
        print(f"{recovery['role']}: noticed after {recovery['detected_after_s']:.1f}s, "
              f"back after {recovery['replaced_after_s']:.1f}s")
    assert recovered["rollout"]["groups_requeued"] == health["prompts"]["groups_requeued"]
    # the new engine pulled the latest weights from DCS before generating: not the initial ones, not a file
    rollout = recovered["rollout"]
    assert rollout["weights_at_death"] > 0
    assert rollout["replacement_weight_version"] >= rollout["weights_at_death"], rollout


def test_a_lost_actor_restarts_from_its_checkpoint_and_the_bus_keeps_its_samples(tiny_path, tmp_path):
    """Global recovery: the Actor (stateful) is killed mid-run; its replacement loads the newest
    checkpoint, every engine rolls back to those weights, and the run redoes the lost steps with
    the samples already on the bus (those within max_staleness) and new ones."""
    config = toy_config(tiny_path, tmp_path, train__steps=12, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2, train__checkpoint_every=4, train__step_timeout_s=300,
                        train__heartbeat_timeout_s=10, reward__name="tests.integration.toy_task:paced_count_a")
    config.faults = [FaultConfig(role="actor", at_step=6, kind="kill")]
    run_dir = run_async(config, echo=print)

    health = json.loads((run_dir / "health.json").read_text())
    (actor,) = [r for r in health["recoveries"] if r["role"] == "actor"]
    assert actor["scope"] == "global" and actor["replaced_after_s"] is not None
    print(f"actor: back {actor['replaced_after_s']:.1f}s after its last heartbeat")
    # killed right after its step 6, the trainer restarts from its own step-4 checkpoint
    assert health["weights"]["rollbacks"] == [[6, 4]]
    lost, restored = 6, 4
    assert health["samples_rolled_back"] == (lost - restored) * 16

    records = [r for r in read_metrics(run_dir) if "trained_samples" in r]
    steps = [r["step"] for r in records]
    assert steps[-1] == 12  # the run completed
    assert steps[-8:] == list(range(5, 13)), steps  # the new trainer reported steps 5 to 12
    for r in records:  # every step, redone ones included, accounts for all its rows
        assert r["trained_samples"] + sum(v for k, v in r.items() if k.startswith("filtered_")) == 16
    assert records[-1]["total_samples_duplicated"] == 0


def test_a_lost_critic_restarts_from_its_own_checkpoint(tiny_path, tmp_path):
    """PPO in async mode: the Critic (stateful: the value model's optimizer) is killed mid-run. Its
    replacement loads the Critic's newest checkpoint, not the initial value model, takes back the
    rows the dead one held, and the run completes with nothing trained twice."""
    config = toy_config(tiny_path, tmp_path, train__steps=12, train__mode="async", train__max_staleness=1,
                        rollout__prompts_per_step=2, algorithm__advantage="gae", train__checkpoint_every=2,
                        train__step_timeout_s=300, train__heartbeat_timeout_s=10,
                        reward__name="tests.integration.toy_task:paced_count_a")
    config.faults = [FaultConfig(role="critic", at_step=4, kind="kill")]
    run_dir = run_async(config, echo=print)

    health = json.loads((run_dir / "health.json").read_text())
    (critic,) = [r for r in health["recoveries"] if r["role"] == "critic"]
    assert critic["scope"] == "global" and critic["replaced_after_s"] is not None
    print(f"critic: back {critic['replaced_after_s']:.1f}s after the kill")
    records = [r for r in read_metrics(run_dir) if "trained_samples" in r]
    assert records[-1]["step"] == 12 and records[-1]["total_samples_duplicated"] == 0
    for r in records:
        assert r["trained_samples"] + sum(v for k, v in r.items() if k.startswith("filtered_")) == 16
    critic_steps = [int(r["critic_step"]) for r in records if "critic_step" in r]
    assert critic_steps.count(1) == 1, critic_steps  # the replacement did not start from scratch
    assert (run_dir / "checkpoints" / "critic" / "step_000002").is_dir()
