"""Fault injection in async mode: killed and hung stateless roles are replaced, their unfinished
work goes back to the bus or the prompt source, and no sample is lost or trained twice.

The faults are injected on purpose (`faults` in the config): a replica's process exits, its
worker loop blocks without a heartbeat, or its worker loop raises (an out-of-memory error).
Everything else is the real run."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from rlx.config import FaultConfig
from rlx.obs.metrics import read_metrics
from rlx.orchestration.async_run import run_async
from rlx.orchestration.faults import INJECTED_ERROR
from rlx.orchestration.run_dir import latest_checkpoint
from rlx.run_state import load_run_state
from tests.integration.test_colocate_loop import toy_config


def short_groups(run_dir: Path, n: int) -> dict[int, int]:
    """Every prompt group of the run, per group, from the final checkpoint: samples the trainer
    counted (`samples_per_group`, carried across recoveries and resumes) plus rows still on the bus
    untrained. Asserts no group got more than `n` (nothing trained twice) and returns the groups
    that got fewer, with how many they lack, leaving out those still being generated at the end
    (the prompt source's unfinished ones). Nothing lost: empty, or, after a global recovery of the
    Actor, exactly the samples of the rolled-back steps."""
    state = load_run_state(latest_checkpoint(run_dir))
    trained, bus = state["samples_per_group"], state["bus"]
    waiting = Counter(group for _, group, _, _, consumed in bus["rows"] if "train" not in consumed)
    made = (set(bus["rows_per_group"]) | set(trained)) - set(state["prompts"]["unfinished"])
    assert made, "no group was made"
    have = {g: trained.get(g, 0) + waiting[g] for g in made}
    assert max(have.values()) <= n, {g: c for g, c in have.items() if c > n}
    return {g: n - c for g, c in sorted(have.items()) if c < n}


def paced_async_config(tiny_path, tmp_path, **overrides):
    """Async steps of 16 samples (12 unless overridden), paced to about 2 s a step so the driver
    sees each step (and injects a fault after it) while it happens. The paced reward takes 1 s a
    sample, so the held-out evaluations score only 4 prompts."""
    paced = {"train__steps": 12, "train__mode": "async", "train__max_staleness": 1, "rollout__prompts_per_step": 2,
             "train__step_timeout_s": 300, "train__heartbeat_timeout_s": 10, "data__eval_size": 4,
             "reward__name": "tests.integration.toy_task:paced_count_a"}
    return toy_config(tiny_path, tmp_path, **{**paced, **overrides})


def test_killed_and_hung_roles_recover_and_nothing_is_lost(tiny_path, tmp_path):
    # the trainer cannot outrun a dead producer by more than max_staleness steps, so every fault must be
    # recovered for the run to reach its last step
    # KL to a reference and decoupled PPO bring in the Reference and ActorFwd roles, killed too; the DCS
    # coordinator is killed, then hung. The Reference runs two replicas: the role serves on while one is replaced
    # A fault fires once the driver sees its step; two roles fail together each time (they recover
    # side by side, and the run must get both back: each is on the Actor's path, or stalls it within
    # max_staleness)
    config = paced_async_config(tiny_path, tmp_path, train__steps=9, train__hang_timeout_s=6,
                                algorithm__kl_coef=0.05, algorithm__behavior_correction="decoupled",
                                resources__reference={"replicas": 2})
    config.faults = [FaultConfig(role="reward", at_step=2, kind="kill"),
                     FaultConfig(role="advantages", at_step=2, kind="hang"),
                     FaultConfig(role="rollout", at_step=3, kind="kill"),
                     FaultConfig(role="reference", at_step=3, kind="kill"),
                     FaultConfig(role="actor_fwd", at_step=4, kind="kill"),
                     FaultConfig(role="dcs", at_step=4, kind="kill"),  # the weight coordinator
                     FaultConfig(role="dcs", at_step=6, kind="hang")]
    said: list[str] = []
    run_dir = run_async(config, echo=lambda line: (said.append(line), print(line)))
    # no periodic checkpoint: the run's start says what a lost Actor would cost
    assert any(line.startswith("recovery: train.checkpoint_every=0: no checkpoint before the last step")
               for line in said), said

    steps = [r for r in read_metrics(run_dir) if "trained_samples" in r]
    assert [r["step"] for r in steps] == list(range(1, 10))  # the run completed
    assert short_groups(run_dir, config.rollout.n) == {}  # every group whole: nothing lost, nothing twice
    assert steps[-1]["total_samples_duplicated"] == 0  # no sample reached the trainer twice
    for r in steps:  # every row of every step is accounted for: trained or filtered with a reason
        assert r["trained_samples"] + sum(v for k, v in r.items() if k.startswith("filtered_")) == 16

    health = json.loads((run_dir / "health.json").read_text())
    recovered = {r["role"]: r for r in health["recoveries"]}
    assert set(recovered) == {"reward", "rollout", "advantages", "reference", "actor_fwd", "dcs"}, health
    assert [r["role"] for r in health["recoveries"]].count("dcs") == 2  # killed, then hung
    assert steps[-1]["recoveries"] == 7  # the five roles and the coordinator twice, all counted
    for recovery in health["recoveries"]:  # each role was noticed dead and served again by a new replica
        assert recovery["detected_after_s"] is not None and recovery["replaced_after_s"] is not None
        print(f"{recovery['role']}: noticed after {recovery['detected_after_s']:.1f}s, "
              f"new replica after {recovery['replaced_after_s']:.1f}s, role down {recovery['role_down_s']:.1f}s")
    assert recovered["reference"]["others_serving"] == 1 and recovered["reference"]["role_down_s"] == 0.0
    assert recovered["rollout"]["role_down_s"] == recovered["rollout"]["replaced_after_s"]  # its only replica
    assert recovered["rollout"]["groups_requeued"] == health["prompts"]["groups_requeued"]
    # the new engine pulled the latest weights from DCS before generating: not the initial ones (version 0),
    # not a file. (`weights_at_death` is what the coordinator held when the death was noticed: -1 when that
    # was just after the coordinator's own replacement, which starts empty until the Actor publishes again.)
    rollout = recovered["rollout"]
    assert rollout["replacement_weight_version"] > 0, rollout
    assert rollout["replacement_weight_version"] >= rollout["weights_at_death"], rollout


def recovered_globally(run_dir, role: str) -> tuple[dict, list[dict]]:
    """Checks shared by the stateful-role tests: `role` was replaced from its checkpoint, the run
    completed its 12 steps, every step (redone ones included) accounts for all 16 of its rows, and
    nothing was trained twice. Returns health.json and the step records."""
    health = json.loads((run_dir / "health.json").read_text())
    (recovery,) = [r for r in health["recoveries"] if r["role"] == role]
    assert recovery["scope"] == "global" and recovery["replaced_after_s"] is not None
    print(f"{role}: back {recovery['replaced_after_s']:.1f}s after the fault")
    records = [r for r in read_metrics(run_dir) if "trained_samples" in r]
    assert records[-1]["step"] == 12 and records[-1]["total_samples_duplicated"] == 0
    for r in records:
        assert r["trained_samples"] + sum(v for k, v in r.items() if k.startswith("filtered_")) == 16
    return health, records


def test_a_lost_critic_and_a_lost_actor_restart_from_their_own_checkpoints(tiny_path, tmp_path):
    """Global recovery of both stateful roles in one PPO run. The Critic (the value model's optimizer)
    is killed first: its replacement loads the Critic's newest checkpoint, not the initial value
    model, and takes back the rows the dead one held. Then the Actor's worker raises an
    out-of-memory error (injected): that counts as a lost Actor, so its replacement loads the
    newest checkpoint, every engine rolls back to those weights, and the run redoes the lost step
    with the samples already on the bus (those within max_staleness) and new ones. The run
    completes with nothing trained twice, and the only samples missing are the rolled-back ones."""
    config = paced_async_config(tiny_path, tmp_path, algorithm__advantage="gae", train__checkpoint_every=2)
    config.faults = [FaultConfig(role="critic", at_step=4, kind="kill"),
                     FaultConfig(role="actor", at_step=7, kind="raise")]
    said: list[str] = []
    run_dir = run_async(config, echo=lambda line: (said.append(line), print(line)))
    assert "recovery: train.checkpoint_every=2: a lost Actor or a crashed run redoes at most 1 step (up to 16 " \
           "samples rolled back)" in said

    _, records = recovered_globally(run_dir, "critic")
    critic_steps = [int(r["critic_step"]) for r in records if "critic_step" in r]
    assert critic_steps.count(1) == 1, critic_steps  # the replacement did not start from scratch
    assert (run_dir / "checkpoints" / "critic" / "step_000002").is_dir()

    health, records = recovered_globally(run_dir, "actor")
    # the Actor kills itself right after its own step 7 (before another step can run): the trainer
    # restarts from its own step-6 checkpoint
    ((lost, restored),) = health["weights"]["rollbacks"]
    assert restored == 6 and lost == 7, health["weights"]["rollbacks"]
    assert health["samples_rolled_back"] == (lost - restored) * 16
    steps = [r["step"] for r in records]
    assert steps[-6:] == list(range(7, 13)), steps  # the new trainer reported steps 7 to 12
    assert any(f"its worker failed: RuntimeError: {INJECTED_ERROR}" in line for line in said), said
    # the groups the lost step trained are never trained again: exactly its rows are missing
    short = short_groups(run_dir, config.rollout.n)
    assert sum(short.values()) == health["samples_rolled_back"], short
