"""Memory of the Actor per rank: one rank against two, on the same model and batch, in one run.

Each group trains one step (so gradients and AdamW state exist) on the same fixed batch of
chain_sum-sized samples, then every rank reports the bytes of its parameter, gradient and
optimizer-state shards, its resident memory now, and its peak resident memory. Both groups run the
same FSDP2 engine (a 1-rank group shards nothing), so the ratio is the sharding's alone.
"""

from __future__ import annotations

import functools
import random

from rlx.data.sample import Sample

MODEL = "smollm2-135m-instruct"
PARTS = ("parameters", "gradients", "optimizer")


def _samples(count: int = 8, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(uid=i, group_id=i // 4, prompt_ids=[rng.randrange(100, 30000) for _ in range(48)],
                   response_ids=[rng.randrange(100, 30000) for _ in range(24)], advantage=rng.choice([-1.0, 1.0]))
            for i in range(count)]


def _measure(ranks: int, model: str) -> list[dict[str, int]]:
    from rlx.config import build_config
    from rlx.models import resolve_model_path
    from rlx.orchestration.builder import build_actor_rank
    from rlx.orchestration.rank_group import RankGroup

    config = build_config({"model": {"path": model}, "train": {"micro_batch_size": 4}})
    group = RankGroup(functools.partial(build_actor_rank, config, resolve_model_path(model)), ranks,
                      num_cpus=0.5, num_gpus=0, threads=max(1, 2 // ranks))
    try:
        samples = _samples()
        group.begin_step()
        for start in range(0, len(samples), 4):
            group.accumulate(samples[start : start + 4])
        group.finish_step()
        return group.memory()
    finally:
        group.close()


def run_shards_benchmark(model: str = MODEL) -> dict[int, list[dict[str, int]]]:
    from rlx.orchestration.cluster import start_ray, stop_ray

    start_ray(num_cpus=8)
    try:
        return {ranks: _measure(ranks, model) for ranks in (1, 2)}
    finally:
        stop_ray()


def format_table(result: dict[int, list[dict[str, int]]], model: str = MODEL) -> str:
    one, two = result[1][0], result[2]
    rows = ["| per rank | 1 rank | 2 ranks (largest rank) | ratio |", "|---|---|---|---|"]
    for part in (*PARTS, "rss", "peak_rss"):
        largest = max(r[part] for r in two)
        rows.append(f"| {part.replace('_', ' ')} | {one[part] / 2**20:.0f} MiB | {largest / 2**20:.0f} MiB | "
                    f"{largest / one[part]:.2f} |")
    tensors = sum(one[p] for p in PARTS), max(sum(r[p] for p in PARTS) for r in two)
    rest = one["rss"] - tensors[0], max(r["rss"] - sum(r[p] for p in PARTS) for r in two)
    return "\n".join([
        (f"{model}: the Actor's FSDP2 engine on 1 and on 2 CPU ranks (gloo), after one optimizer step on the "
        "same 8 samples (72 tokens each). Tensor bytes are the rank's own shards; RSS is the rank process's."), "",
        *rows, "",
        (f"Parameters, gradients and AdamW state per rank: {tensors[1] / 2**20:.0f} MiB on 2 ranks against "
        f"{tensors[0] / 2**20:.0f} MiB on 1 (**{tensors[1] / tensors[0]:.2f}x**). Beside them a rank process holds "
        f"{rest[1] / 2**20:.0f} MiB on 2 ranks and {rest[0] / 2**20:.0f} MiB on 1 (Python, torch, transformers, "
        "the whole model each rank loads before sharding it, communication buffers, allocator caches), which "
        "sharding does not divide: on a 135M model it is as large as the shards, so RSS falls far less than the "
        "tensors; on a 7B policy (112 GB of fp32 weights, gradients and AdamW state) the tensors dominate."),
    ])
