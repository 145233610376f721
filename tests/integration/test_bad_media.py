"""A media file that passes the load-time checks but does not decode fails its own group, counted, and
never the rollout (review security-2026-12-05 N8): before, `Rollout.generate` raised, the replica
died, and its replacement took the same group first, until the run stopped."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from rlx.config import DataConfig
from rlx.data.prompts import with_model_placeholders
from rlx.data.rows import PromptRow
from rlx.engines.generation.base import SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.media.loading import MediaItem
from rlx.media.processor import processor_for
from rlx.models import load_pretrained
from rlx.models.tiny_vl import build_tiny_vl
from rlx.rewards import build_reward
from rlx.roles import Reward, Rollout

N = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, tokenizer = load_pretrained(build_tiny_vl(tmp_path_factory.mktemp("models") / "qwen2_vl", "qwen2_vl"))
    return model.eval(), tokenizer


def _truncated_png(path) -> str:
    encoded = io.BytesIO()
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(encoded, format="PNG")
    path.write_bytes(encoded.getvalue()[: len(encoded.getvalue()) // 2])
    return str(path)


@pytest.mark.parametrize("workers,refill", [(0, False), (1, False), (0, True)],
                         ids=["in_process", "processor_pool", "async_refill"])
def test_an_undecodable_image_fails_only_its_group(tiny, tmp_path, workers, refill):
    """`refill`: the groups after the first come in through `more_groups`, as an async replica's do."""
    model, tokenizer = tiny
    data = DataConfig(media_keys={"image": "images"}, processor_workers=workers)
    if workers:
        from rlx.media.pool import MediaProcessorPool

        processor = MediaProcessorPool(model.config, data, workers)
    else:
        processor = processor_for(model.config, data)
    engine = HFGenerationEngine(model, tokenizer.pad_token_id, (tokenizer.eos_token_id,), tokenizer, 8)
    rollout = Rollout(engine, tokenizer, processor)
    good = MediaItem("image", array=np.zeros((28, 28, 3), np.uint8))
    bad = MediaItem("image", path=_truncated_png(tmp_path / "cut.png"))
    rows = [PromptRow("<image> which digit?", "3", source=f"rows.jsonl:{i + 1}", media={"image": (item,)})
            for i, item in enumerate([good, bad, good])]
    prompt = tokenizer(with_model_placeholders("<image> which digit?", rollout.placeholder_text),
                       add_special_tokens=False)["input_ids"]
    groups = [(i, row, prompt) for i, row in enumerate(rows)]
    waiting = groups[1:] if refill else []

    def more_groups(count: int) -> list:
        taken = waiting[:count]
        del waiting[:count]
        return taken

    try:
        samples = list(rollout.generate(groups[:1] if refill else groups, N,
                                        SamplingParams(temperature=1.0, max_new_tokens=4, seed=0),
                                        more_groups=more_groups if refill else None))
    finally:
        if workers:
            processor.close()
    assert sorted(s.group_id for s in samples) == [0, 0, 1, 1, 2, 2]
    failed = [s for s in samples if s.group_id == 1]
    assert all(s.finish_reason == "bad_media" and s.response_ids == [] for s in failed)
    assert all("rows.jsonl:2" in s.metadata["rollout_error"]["error"] for s in failed)
    assert all(s.response_ids and s.media_inputs is not None for s in samples if s.group_id != 1)

    reward = Reward(build_reward("exact_match", "none"))
    reward.score(samples)
    assert all(s.reward_error.startswith("the rollout failed: ") for s in failed)
    assert all(s.reward_error is None for s in samples if s.group_id != 1)
    assert reward.failures == {"bad_media": N}


def test_a_colocated_run_with_an_undecodable_image_finishes_and_counts_it(tiny_vision_path, tmp_path):
    import json

    from rlx.config import build_config
    from rlx.obs.metrics import read_metrics
    from rlx.orchestration.colocate import run_colocate

    (tmp_path / "pics").mkdir()
    Image.fromarray(np.full((8, 8, 3), 200, np.uint8)).save(tmp_path / "pics" / "good.png")
    _truncated_png(tmp_path / "pics" / "cut.png")
    rows = [{"prompt": "<image> which digit?", "label": "1", "images": [f"pics/{'cut' if i == 5 else 'good'}.png"]}
            for i in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = build_config({
        "model": {"path": str(tiny_vision_path)},
        "data": {"source": "jsonl", "path": str(tmp_path / "rows.jsonl"), "media_keys": {"image": "images"},
                 "eval_size": 0},
        "rollout": {"n": N, "prompts_per_step": 4, "max_new_tokens": 3},
        "reward": {"name": "exact_match", "extract": "last_number"},
        "train": {"steps": 2, "micro_batch_size": 8, "eval_every": 0, "checkpoint_every": 0, "check_bus_schema": True},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False},
    })
    steps = [r for r in read_metrics(run_colocate(config, echo=lambda _: None)) if "reward_failed" in r]
    assert len(steps) == 2 and sum(r["reward_failed"] for r in steps) == N
