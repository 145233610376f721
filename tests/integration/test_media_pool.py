"""Media processed in a pool of processes (`data.processor_workers`): the same inputs as the
rollout's own processor, in order, a refused row refused the same way, a dead process replaced."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from rlx.config import DataConfig, build_config
from rlx.errors import DataError
from rlx.media.pool import MediaProcessorPool
from rlx.media.processor import processor_for
from rlx.models.tiny_omni import (
    AUDIO_TOKEN_ID,
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    build_tiny_omni,
    tiny_omni_model,
)
from rlx.roles.rollout import Rollout
from tests.integration.test_qwen_omni_engine import row_of

I, V, A = IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, AUDIO_TOKEN_ID
ITEMS = [([3, I, 4], row_of(0, [(30, 40)], 0, [])), ([5, A, 6, V], row_of(1, [], 4, [0.8])),
         ([7, I, I, A], row_of(2, [(28, 28), (40, 30)], 0, [1.3])), ([8, 9], row_of(3, [], 0, []))]


@pytest.fixture(scope="module")
def config():
    return tiny_omni_model("qwen2_5_omni").config


@pytest.fixture(scope="module")
def pool(config):
    processors = MediaProcessorPool(config, DataConfig(), workers=2)
    yield processors
    processors.close()


def _same(a, b) -> bool:
    (ids_a, media_a), (ids_b, media_b) = a, b
    return ids_a == ids_b and media_a.keys() == media_b.keys() and all(torch.equal(media_a[k], media_b[k])
                                                                      for k in media_a)


def test_the_pool_gives_what_the_processor_gives_in_order(config, pool):
    local = processor_for(config, DataConfig())
    assert pool.placeholder_ids == local.placeholder_ids
    expected = [local(ids, row) for ids, row in ITEMS]
    got = pool.map(ITEMS)
    assert all(_same(g, e) for g, e in zip(got, expected, strict=True))
    assert len(pool.pool.pids()) == 2  # both processes took groups


def test_a_refused_row_is_the_same_data_error(pool):
    with pytest.raises(DataError, match=r"^rows.jsonl:2: 2 audio placeholder token\(s\)"):
        pool([A, A], row_of(1, [], 0, [0.8]))


def test_a_dead_process_is_replaced(config, pool):
    for pid in pool.pool.pids():
        os.kill(pid, signal.SIGKILL)
    ids, row = ITEMS[0]
    assert _same(pool(ids, row), processor_for(config, DataConfig())(ids, row))


def test_a_rollout_prepares_its_groups_over_the_pool(config, pool, tmp_path):
    local = Rollout(None, None, processor_for(config, DataConfig()))
    pooled = Rollout(None, None, pool)
    items = [(row, ids) for ids, row in ITEMS]
    assert all(_same(g, e) if g[1] is not None else g == e
               for g, e in zip(pooled.prepare_all(items), local.prepare_all(items), strict=True))

    from rlx.orchestration.builder import media_processor

    path = build_tiny_omni(tmp_path / "omni")
    data = {"source": "jsonl", "path": str(tmp_path / "rows.jsonl"), "media_keys": {"image": "images"}}
    built = media_processor(build_config({"data": {**data, "processor_workers": 2}}), path)
    try:
        assert isinstance(built, MediaProcessorPool) and built.workers == 2
    finally:
        built.close()
    assert not isinstance(media_processor(build_config({"data": data}), path), MediaProcessorPool)
