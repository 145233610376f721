"""Rollout throughput of the `hf` and `vllm` engines on the same workload, side by side in one run.

SmolLM2-135M-Instruct, fp32, sampling at temperature 1 on chain_sum prompts (chat template), up to
`max_new_tokens` each. Lengths vary from a handful of tokens to the cap: the long tail RL sees.
Each engine gets the same requests and the same seed; the clock runs from the first request to
the last result, start-up excluded (reported apart).

The bound: a decode step reads every weight once and does two FLOPs per parameter per live row,
so generating `tokens` over `steps` decode steps takes at least
max(steps x weight bytes / memory bandwidth, 2 x parameters x tokens / matmul FLOP/s), both rates
measured on this machine in the same run (a large copy; a matmul of the model's shape at the
batch). Prefill and attention are left out, so the bound is generous to the engines.
"""

from __future__ import annotations

import time

import torch

from rlx.engines.generation import EngineSpec, GenerationRequest, SamplingParams, build_generation_engine

MODEL = "smollm2-135m-instruct"


def _requests(tokenizer, prompts: int) -> list[GenerationRequest]:
    from rlx.data.gym import gym_splits
    from rlx.data.prompts import encode_prompt

    rows = gym_splits("chain_sum", {"min_terms": 2, "max_terms": 2}, prompts, 0, seed=0)[0]
    return [GenerationRequest(i, encode_prompt(row, tokenizer, None, True, 512)) for i, row in enumerate(rows)]


def decode_bound_s(tokens: int, steps: int, parameters: int, weight_bytes: int, bandwidth: float,
                   flops: float) -> float:
    """The fewest seconds any engine needs to decode `tokens` in `steps` steps on this hardware."""
    return max(steps * weight_bytes / bandwidth, 2 * parameters * tokens / flops)


def machine_rates(batch: int, hidden: int, dtype: torch.dtype) -> tuple[float, float]:
    """(memory bandwidth in bytes/s, matmul FLOP/s at a decode step's shape), measured here."""
    source = torch.ones(64 << 20, dtype=torch.float32)  # 256 MB: far past every cache
    target = torch.empty_like(source)
    target.copy_(source)
    started = time.perf_counter()
    for _ in range(5):
        target.copy_(source)
    bandwidth = 2 * source.nbytes * 5 / (time.perf_counter() - started)  # each copy reads and writes
    rows, weight = torch.ones(batch, hidden, dtype=dtype), torch.ones(4 * hidden, hidden, dtype=dtype)
    torch.nn.functional.linear(rows, weight)
    started = time.perf_counter()
    for _ in range(50):
        torch.nn.functional.linear(rows, weight)
    flops = 2 * batch * hidden * 4 * hidden * 50 / (time.perf_counter() - started)
    return bandwidth, flops


def _measure(kind: str, spec: EngineSpec, prompts: int, params: SamplingParams) -> dict[str, float | str]:
    started = time.perf_counter()
    engine, tokenizer = build_generation_engine(kind, spec)
    startup_s = time.perf_counter() - started
    requests = _requests(tokenizer, prompts)
    engine.generate(requests[:4], params)  # warm-up: first-call compilation and allocations
    started = time.perf_counter()
    results = engine.generate(requests, params)
    elapsed = time.perf_counter() - started
    tokens = [len(r.response_ids) for r in results]
    if hasattr(engine, "close"):
        engine.close()
    return {"engine": kind, "startup_s": startup_s, "seconds": elapsed, "tokens_per_s": sum(tokens) / elapsed,
            "samples_per_s": len(results) / elapsed, "mean_tokens": sum(tokens) / len(tokens),
            "at_cap": sum(t >= params.max_new_tokens for t in tokens) / len(tokens),
            "tokens": sum(tokens), "steps": max(tokens)}


def run_engines_benchmark(prompts: int = 64, max_new_tokens: int = 128, engines: tuple[str, ...] = ("hf", "vllm")
                          ) -> list[dict[str, float | str]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlx.models import resolve_model_path

    spec = EngineSpec(resolve_model_path(MODEL), max_batch_size=prompts)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=0)
    rows = [_measure(kind, spec, prompts, params) for kind in engines]
    config = AutoConfig.from_pretrained(spec.path)
    with torch.device("meta"):  # the parameter count from the architecture alone: no weights read
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    bandwidth, flops = machine_rates(prompts, config.hidden_size, torch.float32)
    for row in rows:
        row["bound_s"] = decode_bound_s(row["tokens"], row["steps"], parameters, 4 * parameters, bandwidth, flops)
        row["bandwidth"], row["flops"] = bandwidth, flops
    return rows


def format_table(rows: list[dict[str, float | str]]) -> str:
    base = rows[0]["tokens_per_s"]
    lines = [("| engine | tokens/s | samples/s | vs hf | bound tokens/s | of bound | mean tokens | at cap | "
             "start-up (s) |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bound = r["tokens"] / r["bound_s"]
        lines.append(f"| {r['engine']} | {r['tokens_per_s']:.0f} | {r['samples_per_s']:.2f} | "
                     f"{r['tokens_per_s'] / base:.2f}x | {bound:.0f} | {r['tokens_per_s'] / bound:.0%} | "
                     f"{r['mean_tokens']:.0f} | {100 * r['at_cap']:.0f}% | {r['startup_s']:.0f} |")
    first = rows[0]
    return "\n".join(lines) + (f"\n\nMeasured here in the same run: memory bandwidth {first['bandwidth'] / 1e9:.1f} "
                               f"GB/s, float32 matmul {first['flops'] / 1e9:.0f} GFLOP/s at the decode shape.")
