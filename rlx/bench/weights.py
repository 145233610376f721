"""Weight sync (DCS): publish SmolLM2-135M's fp32 weights to 1 and 2 engines over each channel,
next to one in-memory copy of the same tensors (the physical bound on one machine).

publish-to-loaded runs from the call to `publish` until every subscriber's `hf` engine holds the
version, by the engines' own clocks (one machine, one clock); the acks reach the coordinator a hop
later, which the table shows too. Subscribers apply a received version within a
millisecond, as an engine does between decode steps. Engines take the object-store snapshot as
their weights without a copy (`shared=True`, as Rollout replicas do).
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import ray
import torch
from ray import serve

from rlx.weights import WeightSync
from rlx.weights.buckets import flatten_parameters

MODEL = "smollm2-135m-instruct"
# Versions published before the clock counts: a process pays a page fault the first time it touches
# each page of the object store, which a training run does in its first few publishes only.
WARMUP = 3


@ray.remote(num_cpus=0.1)
class _Engine:
    """An `hf` generation engine subscribed the way a Rollout replica is."""

    def __init__(self, sync: WeightSync, name: str, path: str) -> None:
        from pathlib import Path

        from rlx.engines.generation import EngineSpec, build_generation_engine

        torch.set_num_threads(1)
        self.engine = build_generation_engine("hf", EngineSpec(Path(path)))[0]
        self.subscriber = sync.subscriber(name, self._load)
        self.stopped = threading.Event()
        self.loaded: dict[int, float] = {}  # version -> wall-clock time it was loaded

    def _load(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(state, version, shared=True)
        self.loaded[version] = time.time()

    def loaded_at(self, version: int) -> float:
        return self.loaded[version]

    def start(self) -> int:
        version = self.subscriber.start()
        threading.Thread(target=self._apply_forever, daemon=True).start()
        return version

    def _apply_forever(self) -> None:
        while not self.stopped.is_set():
            if self.subscriber.wait_received(0.5):
                self.subscriber.apply()

    def stop(self) -> None:
        self.stopped.set()
        self.subscriber.close()


def _memcpy_s(state: dict[str, torch.Tensor], repeats: int) -> float:
    targets = {name: torch.empty_like(t) for name, t in state.items()}
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for name, tensor in state.items():
            targets[name].copy_(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _publish_to_loaded(sync: WeightSync, publisher, state, version: int, engines: list,
                       frozen: frozenset[str]) -> dict[str, float]:
    """`loaded_s`: until the last engine held the version (engine clocks; one machine, one clock);
    `acked_s`: until the coordinator had every ack (the publisher's view)."""
    wall, start = time.time(), time.perf_counter()
    timings = publisher.publish(state, version, frozen=frozen)
    if len(sync.wait_acked(version, len(engines), timeout_s=120)) < len(engines):
        raise TimeoutError(f"version {version} was not loaded by {len(engines)} subscribers within 120 s")
    acked_s = time.perf_counter() - start
    loaded_s = max(ray.get([engine.loaded_at.remote(version) for engine in engines])) - wall
    return {**timings, "acked_s": acked_s, "loaded_s": loaded_s}


def run_weights_benchmark(repeats: int = 3, channels: tuple[str, ...] = ("object-store", "gloo"),
                          subscriber_counts: tuple[int, ...] = (1, 2)) -> dict:
    from rlx.models import load_pretrained, resolve_model_path
    from rlx.orchestration.cluster import start_ray, stop_ray

    path = resolve_model_path(MODEL)
    model = load_pretrained(path)[0]
    bucket_mb = 256
    flatten_parameters(model, bucket_mb << 20)  # as the Actor's model is
    state = {name: t.detach() for name, t in model.state_dict().items()}
    unique = {t.data_ptr(): t for t in state.values()}
    size_mb = sum(t.numel() * t.element_size() for t in unique.values()) / 2**20
    memcpy_s = _memcpy_s({str(k): t for k, t in unique.items()}, repeats)
    rows = []
    # a language model frozen under a small trained part (here the final norm stands in for an adapter)
    frozen_lm = frozenset(name for name in state if name != "model.norm.weight")
    start_ray(num_cpus=8)
    serve.start(proxy_location="Disabled")  # the DCS coordinator is a Serve application
    try:
        for channel, count, frozen in itertools.product(channels, subscriber_counts, (frozenset(), frozen_lm)):
            sync = WeightSync.create(channel, bucket_mb=bucket_mb, timeout_s=120)
            publisher = sync.publisher()
            publisher.publish(state, 0, frozen=frozen)
            engines = [_Engine.remote(sync, f"engine-{i}", str(path)) for i in range(count)]
            ray.get([e.start.remote() for e in engines])
            runs = [_publish_to_loaded(sync, publisher, state, version, engines, frozen)
                    for version in range(1, WARMUP + repeats + 1)]
            cold, runs = runs[0], runs[WARMUP:]
            ray.get([e.stop.remote() for e in engines])
            for engine in engines:
                ray.kill(engine)
            sync.close()
            total = statistics.median(r["loaded_s"] for r in runs)
            rows.append({"channel": channel, "subscribers": count, "trained": "adapter" if frozen else "all",
                         "total_s": total, "cold_s": cold["loaded_s"],
                         "acked_s": statistics.median(r["acked_s"] for r in runs),
                         "put_s": statistics.median(r["put_s"] for r in runs),
                         "broadcast_s": statistics.median(r["broadcast_s"] for r in runs),
                         "vs_memcpy": total / memcpy_s})
    finally:
        stop_ray()
    return {"size_mb": size_mb, "memcpy_s": memcpy_s, "rows": rows, "repeats": repeats}


def format_table(result: dict) -> str:
    lines = [(f"SmolLM2-135M fp32, {result['size_mb']:.0f} MB (tied embeddings sent once); one in-memory copy: "
             f"{result['memcpy_s'] * 1000:.0f} ms. Median of {result['repeats']} versions after {WARMUP} unmeasured "
             "ones; `first` is the first of those (fresh object-store pages)."), "",
             ("`trained`: `all` publishes every tensor each version; `adapter` freezes all but the final norm "
              "(as `train.trainable` freezes a language model under an adapter), so the frozen buckets are put "
              "once and each later version puts and broadcasts only the rest."), "",
             ("| channel | subscribers | trained | publish-to-loaded (ms) | x memcpy | put (ms) | broadcast (ms) | "
             "all acks at the coordinator (ms) | first (ms) |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['channel']} | {row['subscribers']} | {row['trained']} | {row['total_s'] * 1000:.0f} | "
                     f"{row['vs_memcpy']:.2f}x | {row['put_s'] * 1000:.0f} | {row['broadcast_s'] * 1000:.0f} | "
                     f"{row['acked_s'] * 1000:.0f} | {row['cold_s'] * 1000:.0f} |")
    return "\n".join(lines)
