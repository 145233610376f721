"""The rlx bus against the `transferqueue` package on the same put/get workloads, in one run.

Two workloads:
- batch: put 64 sequences of 1024 tokens in one call, get them back, clear them;
- per-sample (the RL pattern): 64 samples put one at a time, a reward field added to each one at
  a time, then one batched get of both fields.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

ROWS, TOKENS = 64, 1024


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _rlx_workloads():
    from rlx.bus.ray_bus import Bus

    bus = Bus.create(capacity=10_000)
    batch = [torch.randint(0, 50_000, (TOKENS,)) for _ in range(ROWS)]
    samples = [torch.randint(0, 50_000, (384,)) for _ in range(ROWS)]

    def batch_round():
        rows = bus.put({"ids": batch}, group_ids=list(range(ROWS)), num_tokens=[TOKENS] * ROWS)
        _got, values = bus.get("consumer", ["ids"], ROWS, timeout=30)
        assert len(values["ids"]) == ROWS
        bus.clear(rows)

    def per_sample_round():
        rows = [bus.put({"ids": [s]}, group_ids=[i], num_tokens=[384])[0] for i, s in enumerate(samples)]
        for i, row in enumerate(rows):
            bus.put_fields([row], {"reward": [float(i)]})
        _got, values = bus.get("trainer", ["ids", "reward"], ROWS, timeout=30)
        assert len(values["reward"]) == ROWS
        bus.clear(rows)

    return batch_round, per_sample_round


def _tq_workloads():
    import transfer_queue as tq
    from tensordict import TensorDict

    tq.init()
    batch = torch.randint(0, 50_000, (ROWS, TOKENS))
    samples = [torch.randint(0, 50_000, (384,)) for _ in range(ROWS)]
    counter = iter(range(10**9))

    def batch_round():
        keys = [f"b{next(counter)}" for _ in range(ROWS)]
        tq.kv_batch_put(keys=keys, partition_id="bench", fields=TensorDict({"ids": batch}, batch_size=ROWS))
        out = tq.kv_batch_get(keys=keys, partition_id="bench", select_fields=["ids"])
        assert out["ids"].shape[0] == ROWS
        tq.kv_clear(keys=keys, partition_id="bench")

    def per_sample_round():
        keys = [f"s{next(counter)}" for _ in range(ROWS)]
        for key, sample in zip(keys, samples):
            tq.kv_put(key=key, partition_id="bench", fields={"ids": sample})
        for i, key in enumerate(keys):
            tq.kv_put(key=key, partition_id="bench", fields={"reward": torch.tensor([float(i)])})
        out = tq.kv_batch_get(keys=keys, partition_id="bench", select_fields=["ids", "reward"])
        assert out["reward"].shape[0] == ROWS
        tq.kv_clear(keys=keys, partition_id="bench")

    return batch_round, per_sample_round, tq.close


def run_bus_benchmark(repeats: int = 10) -> list[dict[str, float | str]]:
    """Rows: workload, system, rows/s, median round latency (ms)."""
    from rlx.orchestration.cluster import start_ray

    os.environ.setdefault("TQ_NUM_THREADS", "2")  # transferqueue reads this itself
    start_ray(num_cpus=6)
    results = []
    rlx_batch, rlx_sample = _rlx_workloads()
    tq_batch, tq_sample, tq_close = _tq_workloads()
    try:
        for workload, ours, theirs in (("batch 64x1024", rlx_batch, tq_batch),
                                       ("per-sample RL (64)", rlx_sample, tq_sample)):
            for system, fn in (("rlx bus", ours), ("transferqueue 0.1.11", theirs)):
                times = _timed(fn, repeats)
                results.append({"workload": workload, "system": system,
                                "rows_per_s": ROWS * len(times) / sum(times),
                                "median_ms": 1000 * statistics.median(times)})
    finally:
        tq_close()
    return results


def format_table(results: list[dict]) -> str:
    lines = ["| workload | system | rows/s | median round (ms) | rlx / tq |", "|---|---|---|---|---|"]
    by_workload: dict[str, dict[str, dict]] = {}
    for r in results:
        by_workload.setdefault(r["workload"], {})[r["system"]] = r
    for workload, systems in by_workload.items():
        ours = systems["rlx bus"]["rows_per_s"]
        for name, r in systems.items():
            ratio = f"{ours / r['rows_per_s']:.1f}x" if name != "rlx bus" else ""
            lines.append(f"| {workload} | {name} | {r['rows_per_s']:.0f} | {r['median_ms']:.1f} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(run_bus_benchmark()))
