"""Media on the bus: one stored copy per prompt group against one per sample, in one run.

A step of a vision-language run: `groups` prompts with one 448x448 image each, `n` samples per
prompt. The image becomes Qwen2-VL's `pixel_values` (1024 patches x 1176 values, 4.8 MB in fp32),
through rlx's processor. Two ways to move it over the Ray bus to a trainer that takes every row:
- group: the rollout's way, `put_group` once per prompt group, each row reading the stored object;
- per sample: the media as an ordinary row field, put with each of the n samples.
Reported per step: bytes the producer put into the bus, seconds for the puts and the trainer's
get, and the processor's time per sample when it runs once per group against once per sample.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

IMAGE_SIDE = 448


def _image() -> np.ndarray:
    """A smooth colour gradient with a grid: real pixels for the processor, the same every run."""
    y, x = np.mgrid[0:IMAGE_SIDE, 0:IMAGE_SIDE]
    grid = ((x // 32 + y // 32) % 2) * 64
    return np.stack([x * 255 // IMAGE_SIDE, y * 255 // IMAGE_SIDE, grid], axis=-1).astype(np.uint8)


def _processor() -> Callable[[], dict[str, torch.Tensor]]:
    from rlx.media.qwen_vl import QwenVisionSpec, image_inputs
    from rlx.models.tiny_vl import tiny_vl_model

    _, spec = tiny_vl_model("qwen2_vl")  # real Qwen2-VL geometry (patch 14, merge 2) and normalisation
    spec = QwenVisionSpec(**{**spec.__dict__, "max_pixels": IMAGE_SIDE * IMAGE_SIDE})
    image = _image()
    return lambda: image_inputs([image], spec)


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_mm_benchmark(groups: int = 8, n: int = 8, repeats: int = 5) -> dict[str, float]:
    from rlx.bus.columns import approx_nbytes
    from rlx.bus.ray_bus import Bus
    from rlx.orchestration.cluster import start_ray, stop_ray

    process = _processor()
    media = process()
    per_group_s = _median_s(process, repeats)
    start_ray(num_cpus=4)
    try:
        bus = Bus.create(capacity=10_000)
        responses = [torch.randint(0, 50_000, (64,)) for _ in range(n)]

        def step(shared: bool) -> None:
            rows = []
            for group in range(groups):
                if shared:
                    bus.put_group(group, {"media_inputs": media}, rows=n)
                for response in responses:
                    values = {"response_ids": [response]} if shared else {"response_ids": [response],
                                                                          "media_inputs": [media]}
                    rows += bus.put(values, group_ids=[group], num_tokens=[64])
            taken, values = bus.get("train", ["response_ids", "media_inputs"], groups * n, timeout=120)
            assert len(values["media_inputs"]) == groups * n
            bus.clear(taken)
            bus.flush()

        result = {"groups": float(groups), "n": float(n), "media_mb": approx_nbytes(media) / 1e6,
                  "processor_ms_per_sample_group": 1000 * per_group_s / n,
                  "processor_ms_per_sample_each": 1000 * per_group_s}
        for mode, shared in (("group", True), ("sample", False)):
            result[f"bus_mb_{mode}"] = approx_nbytes(media) * (groups if shared else groups * n) / 1e6
            result[f"step_s_{mode}"] = _median_s(lambda shared=shared: step(shared), repeats)
        return result
    finally:
        stop_ray()


def format_table(r: dict[str, float]) -> str:
    groups, n = int(r["groups"]), int(r["n"])
    return "\n".join([
        (f"A step of {groups} prompt groups x {n} samples, one {IMAGE_SIDE}x{IMAGE_SIDE} image per prompt "
        f"(Qwen2-VL pixel_values, {r['media_mb']:.1f} MB each), put on the Ray bus and taken by one trainer get:"),
        "",
        "| media stored | MB put per step | put + get + clear per step (s) | processor per sample (ms) |",
        "|---|---|---|---|",
        (f"| once per group (`put_group`, rlx) | {r['bus_mb_group']:.0f} | {r['step_s_group']:.3f} | "
        f"{r['processor_ms_per_sample_group']:.1f} |"),
        (f"| once per sample (a row field) | {r['bus_mb_sample']:.0f} | {r['step_s_sample']:.3f} | "
        f"{r['processor_ms_per_sample_each']:.1f} |"),
        "",
        (f"Per-group storage moves {r['bus_mb_sample'] / r['bus_mb_group']:.0f}x fewer bytes and takes "
        f"{r['step_s_sample'] / r['step_s_group']:.1f}x less time per step; processing once per group costs "
        f"1/{n} of processing each sample. Medians of the repeats, measured in one run."),
    ])
