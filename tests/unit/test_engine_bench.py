"""The decoding bound `rlx bench engines` reports each engine against, worked by hand."""

import pytest

from rlx.bench.engines import decode_bound_s, format_table


def test_the_bound_is_the_slower_of_reading_the_weights_and_doing_the_flops():
    # 32 steps reading 540 MB at 20 GB/s: 0.864 s; 640 tokens x 2 x 135M FLOPs at 400 GFLOP/s: 0.432 s
    assert decode_bound_s(640, 32, 135_000_000, 540_000_000, 20e9, 400e9) == pytest.approx(0.864)
    # at 100 GFLOP/s the FLOPs take longer: 1.728 s
    assert decode_bound_s(640, 32, 135_000_000, 540_000_000, 20e9, 100e9) == pytest.approx(1.728)


def test_the_table_gives_each_engine_its_share_of_the_bound():
    row = {"engine": "hf", "tokens_per_s": 100.0, "samples_per_s": 2.0, "mean_tokens": 50.0, "at_cap": 0.1,
           "startup_s": 1.0, "tokens": 640, "bound_s": 1.6, "bandwidth": 20e9, "flops": 400e9}
    table = format_table([row, {**row, "engine": "vllm", "tokens_per_s": 200.0}])
    assert "| hf | 100 | 2.00 | 1.00x | 400 | 25% |" in table  # bound 640 / 1.6 = 400 tokens/s
    assert "| vllm | 200 | 2.00 | 2.00x | 400 | 50% |" in table
    assert "memory bandwidth 20.0 GB/s, float32 matmul 400 GFLOP/s" in table
