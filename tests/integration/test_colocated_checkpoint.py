"""A colocated PPO run checkpoints the Actor and the Critic as one unit and resumes both from it."""

from __future__ import annotations

from rlx.checkpoints import MARKER
from rlx.obs.metrics import read_metrics
from rlx.orchestration.colocate import run_colocate
from tests.integration.test_colocate_loop import toy_config


def test_the_critic_lives_inside_the_actors_checkpoint_and_resumes(tiny_path, tmp_path):
    small = {"algorithm__advantage": "gae", "rollout__n": 2, "rollout__prompts_per_step": 2, "rollout__max_new_tokens": 4,
                 "data__eval_size": 2}
    run_colocate(toy_config(tiny_path, tmp_path, train__steps=1, **small), echo=lambda _: None)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    assert (checkpoint / MARKER).exists() and (checkpoint / "critic" / "optimizer.pt").exists()
    assert not (checkpoint / "critic" / MARKER).exists()  # one marker: one unit
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step_000001"]

    run_dir = run_colocate(toy_config(tiny_path, tmp_path, train__steps=2, **small), resume=True,
                           echo=lambda _: None)
    steps = [r for r in read_metrics(run_dir) if "critic_step" in r]
    assert [int(r["critic_step"]) for r in steps] == [1, 2]  # the Critic went on from its checkpoint
