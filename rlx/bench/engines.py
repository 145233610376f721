"""Rollout throughput of the `hf` and `vllm` engines on the same workload, side by side in one run.

SmolLM2-135M-Instruct, fp32, sampling at temperature 1 on chain_sum prompts (chat template), up to
`max_new_tokens` each. Lengths vary from a handful of tokens to the cap: the long tail RL sees.
Each engine gets the same requests and the same seed; the clock runs from the first request to
the last result, start-up excluded (reported apart).
"""

from __future__ import annotations

import time

from rlx.engines.generation import EngineSpec, GenerationRequest, SamplingParams, build_generation_engine

MODEL = "smollm2-135m-instruct"


def _requests(tokenizer, prompts: int) -> list[GenerationRequest]:
    from rlx.data.gym import gym_splits
    from rlx.data.prompts import encode_prompt

    rows = gym_splits("chain_sum", {"min_terms": 2, "max_terms": 2}, prompts, 0, seed=0)[0]
    return [GenerationRequest(i, encode_prompt(row, tokenizer, None, True, 512)) for i, row in enumerate(rows)]


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
            "at_cap": sum(t >= params.max_new_tokens for t in tokens) / len(tokens)}


def run_engines_benchmark(prompts: int = 64, max_new_tokens: int = 128, engines: tuple[str, ...] = ("hf", "vllm")
                          ) -> list[dict[str, float | str]]:
    from rlx.models import resolve_model_path

    spec = EngineSpec(resolve_model_path(MODEL), max_batch_size=prompts)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=0)
    return [_measure(kind, spec, prompts, params) for kind in engines]


def format_table(rows: list[dict[str, float | str]]) -> str:
    base = rows[0]["tokens_per_s"]
    lines = ["| engine | tokens/s | samples/s | vs hf | mean tokens | at cap | start-up (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['tokens_per_s']:.0f} | {r['samples_per_s']:.2f} | "
                     f"{r['tokens_per_s'] / base:.2f}x | {r['mean_tokens']:.0f} | {100 * r['at_cap']:.0f}% | "
                     f"{r['startup_s']:.0f} |")
    return "\n".join(lines)
