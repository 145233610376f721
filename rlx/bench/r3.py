"""Rollout Routing Replay: what it costs per training step and what it fixes, measured in one run.

One fixed batch is generated once by the `hf` engine in bf16 (routes recorded) from chain_sum
prompts; an fp32 Actor then trains on it, each round taking one step with the routes replayed and
one without, in alternating order (interleaved repeats: drift of the machine hits both modes
alike). The step time is the whole step (forwards, backward, optimizer). Whole training runs would
not be identical work once replay changes the update; these steps are, shape for shape. The
unreplayed extra forward (`routing_mismatch_every`) is off while timing.

The overhead is the median over rounds of each round's time ratio, with a 95% bootstrap interval,
in wall time and in this process's CPU time (all threads): other processes on the machine stretch
a step's wall time but barely its CPU time, so the CPU-time ratio is the steadier of the two.
Identical steps on 2 shared cores vary by about 8% each, so a few-percent overhead is resolved by
many short rounds (a small batch, 80 rounds), not by a few long ones.
Before timing, one measured step reports the mismatch R3 removes: the share of (position, layer)
routes where the fp32 trainer's router would have chosen other experts than the bf16 engine, and
the mean |log-prob| gap between rollout and trainer with and without replay.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from pathlib import Path

from rlx.data.sample import Sample

MODEL = "smollm2-moe-4x135m"


def _batch(model_path: Path, prompts: int, n: int, max_new_tokens: int) -> list[Sample]:
    from rlx.data.gym import gym_splits
    from rlx.data.prompts import encode_prompt
    from rlx.engines.generation import EngineSpec, GenerationRequest, SamplingParams, build_generation_engine

    engine, tokenizer = build_generation_engine("hf", EngineSpec(model_path, "bfloat16", record_routes=True))
    rows = gym_splits("chain_sum", {"min_terms": 2, "max_terms": 2}, prompts, 0, seed=0)[0]
    requests = [GenerationRequest(i * n + k, encode_prompt(row, tokenizer, None, True, 512))
                for i, row in enumerate(rows) for k in range(n)]
    results = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=0))
    return [Sample(uid=r.request_id, group_id=r.request_id // n, prompt_ids=r.prompt_ids, response_ids=r.response_ids,
                   rollout_logprobs=r.logprobs, routed_experts=r.routed_experts,
                   advantage=1.0 if r.request_id % 2 else -1.0)
            for r in results]


def _actor(model_path: Path, micro_batch_size: int, mismatch_every: int):
    from rlx.config import AlgorithmConfig, RunConfig, TrainConfig
    from rlx.engines.training import TrainingEngine
    from rlx.models import load_pretrained
    from rlx.models.moe import MoeRouting
    from rlx.orchestration.plan import build_plan
    from rlx.roles.actor import Actor

    model, tokenizer = load_pretrained(model_path)
    MoeRouting.of(model)
    engine = TrainingEngine(model, tokenizer, TrainConfig(lr=1e-6, micro_batch_size=micro_batch_size), 1.0)
    algorithm = AlgorithmConfig(routing_mismatch_every=mismatch_every)
    inputs = build_plan(RunConfig(model={"path": str(model_path)}, algorithm=algorithm)).inputs("train")
    return Actor(engine, algorithm, tokenizer.pad_token_id, inputs)


def ratio_interval(ratios: list[float], confidence: float = 0.95, draws: int = 2000) -> tuple[float, float]:
    """A percentile-bootstrap interval of the median of `ratios`."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    tail = (1 - confidence) / 2
    return medians[int(tail * draws)], medians[min(draws - 1, int((1 - tail) * draws))]


def run_r3_benchmark(work_dir: Path, repeats: int = 80, prompts: int = 2, n: int = 2,
                     max_new_tokens: int = 32, model: str = MODEL) -> dict[str, float | str]:
    from rlx.models import resolve_model_path

    work_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(model)
    samples = _batch(model_path, prompts, n, max_new_tokens)
    unreplayed = [dataclasses.replace(s, routed_experts=None) for s in samples]
    actor = _actor(model_path, micro_batch_size=len(samples), mismatch_every=1)
    measured = actor.train(samples)  # the mismatch step: replayed, plus one unreplayed forward
    actor.config = actor.config.model_copy(update={"routing_mismatch_every": 0})
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(repeats):
        for replay in ((True, False) if round_ % 2 else (False, True)):
            started, started_cpu = time.perf_counter(), time.process_time()
            actor.train(samples if replay else unreplayed)
            wall[replay].append(time.perf_counter() - started)
            cpu[replay].append(time.process_time() - started_cpu)
    ratios = [r3 / off for r3, off in zip(wall[True], wall[False])]
    cpu_ratios = [r3 / off for r3, off in zip(cpu[True], cpu[False])]
    low, high = ratio_interval(ratios)
    cpu_low, cpu_high = ratio_interval(cpu_ratios)
    return {
        "model": model, "samples": len(samples), "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
        "repeats": repeats, "step_s_r3": statistics.median(wall[True]), "step_s_off": statistics.median(wall[False]),
        "overhead": statistics.median(ratios) - 1, "overhead_low": low - 1, "overhead_high": high - 1,
        "cpu_s_r3": statistics.median(cpu[True]), "cpu_s_off": statistics.median(cpu[False]),
        "cpu_overhead": statistics.median(cpu_ratios) - 1, "cpu_overhead_low": cpu_low - 1,
        "cpu_overhead_high": cpu_high - 1,
        "route_mismatch_fraction": measured["route_mismatch_fraction"],
        "logprob_gap_r3": measured["rollout_logprob_abs_diff"],
        "logprob_gap_off": measured["rollout_logprob_abs_diff_unreplayed"],
    }


def format_table(result: dict[str, float | str]) -> str:
    r = result
    return "\n".join([
        (f"{r['model']}: bf16 `hf` engine (routes recorded) -> fp32 Actor, one fixed batch of {r['samples']} samples "
        f"({r['tokens']} tokens), {r['repeats']} interleaved rounds of one step each way."),
        "",
        "| | without replay | with R3 |",
        "|---|---|---|",
        f"| median step time | {r['step_s_off']:.2f} s | {r['step_s_r3']:.2f} s |",
        f"| median CPU time per step (this process, all threads) | {r['cpu_s_off']:.2f} s | {r['cpu_s_r3']:.2f} s |",
        f"| mean \\|rollout - trainer log-prob\\| | {r['logprob_gap_off']:.4f} | {r['logprob_gap_r3']:.4f} |",
        "",
        (f"Overhead of R3: **{100 * r['overhead']:+.1f}%** per step (median of per-round ratios; 95% bootstrap "
        f"interval {100 * r['overhead_low']:+.1f}% to {100 * r['overhead_high']:+.1f}%); in CPU time "
        f"**{100 * r['cpu_overhead']:+.1f}%** ({100 * r['cpu_overhead_low']:+.1f}% to "
        f"{100 * r['cpu_overhead_high']:+.1f}%). Routes where the trainer's "
        f"own router would have chosen other experts than the engine: {100 * r['route_mismatch_fraction']:.2f}% of "
        "(position, layer) pairs."),
    ])
