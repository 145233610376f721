"""rlx against TRL's `GRPOTrainer` on identical settings, side by side in one run.

Both train the same model on the same prompts in the same order (rlx's prompt stream), with the
same reward function, group size, sampling, learning rate, loss (token-mean clipped surrogate, no
KL, one update per batch) and sample budget. Each system runs in a fresh process of its own, one
after the other, so start-up is measured from the process launch to the first step's start and
neither shares the cores with the other. Both final models (and the initial one, once) are then
scored by the same greedy evaluator on the same held-out problems, in float32.

Systems: `trl` and `rlx` (float32, `rollout.engine=hf`), their bfloat16 variants (`trl-bf16`:
TRL's `bf16=True`; `rlx-bf16`: a bfloat16 engine and bfloat16 autocast training with float32
master weights) and `rlx-vllm` (the float32 vLLM engine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlx.config import RunConfig, build_config
from rlx.data.rows import PromptRow

SYSTEMS = ("trl", "rlx", "trl-bf16", "rlx-bf16", "rlx-vllm")


@dataclass(frozen=True)
class Settings:
    """What both systems are given; the issue's matched settings by default."""

    model: str = "smollm2-135m-instruct"
    task_params: dict[str, int] = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    system_prompt: str = "Solve the arithmetic problem. Reply with only the final number."
    prompts_per_step: int = 4
    n: int = 8
    max_new_tokens: int = 32
    temperature: float = 0.7
    lr: float = 5e-6
    steps: int = 30
    micro_batch_size: int = 16
    train_size: int = 5000
    eval_size: int = 500
    seed: int = 0


def rlx_config(settings: Settings, run_dir: Path, system: str = "rlx", eval_size: int = 0) -> RunConfig:
    """The rlx run of `system`; with `eval_size`, the config the shared evaluator reads its
    held-out rows and reward from."""
    dtype = "bfloat16" if system == "rlx-bf16" else "float32"
    return build_config({
        "model": {"path": settings.model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "task_params": settings.task_params,
                 "train_size": settings.train_size, "eval_size": eval_size, "seed": settings.seed,
                 "system_prompt": settings.system_prompt},
        "rollout": {"engine": "vllm" if system == "rlx-vllm" else "hf", "n": settings.n,
                    "prompts_per_step": settings.prompts_per_step, "temperature": settings.temperature,
                    "max_new_tokens": settings.max_new_tokens, "dtype": dtype},
        "reward": {"name": "reasoning_gym", "extract": "last_number"},
        "algorithm": {"advantage": "grpo", "loss": {"type": "clipped", "clip_low": 0.2, "clip_high": 0.2},
                      "aggregation": "token-mean", "kl_coef": 0.0},
        "train": {"steps": settings.steps, "lr": settings.lr, "micro_batch_size": settings.micro_batch_size,
                  "param_dtype": dtype, "eval_every": 0, "checkpoint_every": 0, "seed": settings.seed},
        "logging": {"run_dir": str(run_dir), "progress_bar": False},
    })


def train_prompts(settings: Settings) -> list[PromptRow]:
    """The rows rlx's run takes, in the order it takes them: TRL gets exactly these."""
    from rlx.data import PromptStream, load_splits

    config = rlx_config(settings, Path("unused"))
    stream = PromptStream(load_splits(config.data)[0], seed=config.data.seed)
    return [row for _, row in stream.take(settings.steps * settings.prompts_per_step)]


# ------------------------------------------------------------------------------ the two children

def run_rlx(settings: Settings, system: str, out: Path) -> dict[str, Any]:
    """Train with rlx's colocated loop; times from its metrics and its timeline (wall clock)."""
    from rlx.obs.metrics import read_metrics
    from rlx.obs.timeline import SPANS
    from rlx.obs.trace import read_trace
    from rlx.orchestration.colocate import run_colocate
    from rlx.orchestration.run_dir import latest_checkpoint

    SPANS.launch_is_this_run()
    run_dir = run_colocate(rlx_config(settings, out / "run", system), overwrite=True, echo=lambda _: None)
    steps = [r for r in read_metrics(run_dir) if "time_step_s" in r]
    first_start = min(s.t0 for s in read_trace(run_dir).spans if s.name == "generate") / 1e6
    # metrics' wall_time_s share one clock; a step ends at its wall time and lasts time_step_s
    span_s = steps[-1]["wall_time_s"] - (steps[0]["wall_time_s"] - steps[0]["time_step_s"])
    return {"first_step_at": first_start, "train_s": span_s, "steps": len(steps),
            "step_s": [r["time_step_s"] for r in steps], "reward": [r["reward_mean"] for r in steps],
            "model_dir": str(latest_checkpoint(run_dir))}


def trl_reward(rows: list[PromptRow], config: RunConfig) -> Callable[..., list[float]]:
    """TRL's reward function: rlx's own Reward role of `config` (its reward pool, its deadline), so
    both systems score alike; a failed sample scores 0, as rlx's evaluator counts it."""
    from rlx.data.sample import Sample
    from rlx.orchestration.builder import build_reward_role

    role = build_reward_role(config)

    def reward(completions: list, index: list[int], **_: Any) -> list[float]:
        samples = [Sample(uid=k, group_id=i, response_text=c[-1]["content"], label=rows[i].label,
                          metadata=rows[i].metadata) for k, (c, i) in enumerate(zip(completions, index))]
        return [s.reward for s in role.score(samples)]

    return reward


def run_trl(settings: Settings, system: str, out: Path) -> dict[str, Any]:
    """Train with TRL's GRPOTrainer on the same rows, reward, sampling and optimizer settings."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlx.data.prompts import prompt_token_ids
    from rlx.models import resolve_model_path

    rows = train_prompts(settings)
    model_path = str(resolve_model_path(settings.model))
    messages = [[{"role": "system", "content": settings.system_prompt}, {"role": "user", "content": row.prompt}]
                for row in rows]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    theirs = tokenizer.apply_chat_template(messages[0], add_generation_prompt=True, tokenize=True, return_dict=False)
    ours = prompt_token_ids(rows[0], tokenizer, settings.system_prompt, True)
    if list(theirs) != list(ours):
        raise RuntimeError(f"TRL's prompt tokens differ from rlx's: {list(theirs)[:20]}... vs {ours[:20]}...")
    reward = trl_reward(rows, rlx_config(settings, out / "run"))

    starts: list[float] = []
    ends: list[float] = []
    rewards: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            starts.append(time.time())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            ends.append(time.time())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **__: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    args = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=settings.prompts_per_step * settings.n,
        num_generations=settings.n, max_completion_length=settings.max_new_tokens,
        temperature=settings.temperature, learning_rate=settings.lr, lr_scheduler_type="constant",
        max_steps=settings.steps, epsilon=0.2, beta=0.0, loss_type="dapo", num_iterations=1,
        shuffle_dataset=False, seed=settings.seed, model_init_kwargs={"dtype": "float32"}, use_cpu=True,
        bf16=system == "trl-bf16", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0)
    dataset = Dataset.from_list([{"prompt": m, "index": i} for i, m in enumerate(messages)])
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=args, train_dataset=dataset,
                          callbacks=[Clock()])
    trainer.train()
    model_dir = out / "model"
    trainer.save_model(str(model_dir))
    return {"first_step_at": starts[0], "train_s": ends[-1] - starts[0], "steps": len(ends),
            "step_s": [e - s for s, e in zip(starts, ends)], "reward": rewards, "model_dir": str(model_dir)}


# ------------------------------------------------------------------------------ the parent

def run_system(settings: Settings, system: str, work_dir: Path) -> dict[str, Any]:
    """One system in a fresh process (its output in `<work_dir>/<system>/log.txt`); start-up counts
    from the launch. A system that fails is reported as failed, and the others still run."""
    out = work_dir / system
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(asdict(settings)))
    (out / "result.json").unlink(missing_ok=True)
    launched = time.time()
    with (out / "log.txt").open("w") as log:
        code = subprocess.run([sys.executable, "-m", "rlx.bench.trl", system, str(out)], stdout=log,
                              stderr=subprocess.STDOUT, check=False,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}).returncode
    if code != 0:
        return {"error": f"exit status {code}, see {out / 'log.txt'}"}
    result = json.loads((out / "result.json").read_text())
    result["startup_s"] = result["first_step_at"] - launched
    return result


def held_out_accuracy(settings: Settings, model_dir: Path) -> float:
    """Greedy accuracy on the held-out problems, by rlx's evaluator with a float32 `hf` engine."""
    from rlx.data import load_splits
    from rlx.orchestration.builder import build_reward_role, build_rollout, prompt_encoder, sampling_params
    from rlx.orchestration.evaluation import evaluate

    config = rlx_config(settings, Path("unused"), eval_size=settings.eval_size)
    rollout = build_rollout(config, model_dir)
    metrics = evaluate(rollout, build_reward_role(config), load_splits(config.data)[1],
                       prompt_encoder(config, rollout), sampling_params(config, seed=0, greedy=True))
    return metrics["eval_accuracy"]


def run_trl_benchmark(work_dir: Path, settings: Settings = Settings(),
                      systems: tuple[str, ...] = SYSTEMS) -> dict[str, Any]:
    from rlx.models import resolve_model_path

    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    rows = {system: run_system(settings, system, work_dir) for system in systems}
    before = held_out_accuracy(settings, resolve_model_path(settings.model))
    for row in rows.values():
        if "error" not in row:
            row["after"] = held_out_accuracy(settings, Path(row["model_dir"]))
    return {"settings": asdict(settings), "before": before, "rows": rows}


def format_table(result: dict[str, Any]) -> str:
    settings = result["settings"]
    samples = settings["prompts_per_step"] * settings["n"]
    rows = result["rows"]
    base = rows.get("trl", {"error": "not run"})
    base_rate = samples * base["steps"] / base["train_s"] if "error" not in base else float("nan")
    lines = [("| system | samples/s | vs trl | s/step (median) | start-up to first step | held-out accuracy "
             "before → after | gain |"), "|---|---|---|---|---|---|---|"]
    for system, r in rows.items():
        if "error" in r:
            lines.append(f"| {system} | failed: {r['error']} | | | | | |")
            continue
        rate = samples * r["steps"] / r["train_s"]
        median = sorted(r["step_s"])[len(r["step_s"]) // 2]
        lines.append(f"| {system} | {rate:.2f} | {rate / base_rate:.2f}x | {median:.2f} s | {r['startup_s']:.1f} s | "
                     f"{result['before']:.3f} → {r['after']:.3f} | **{r['after'] - result['before']:+.3f}** |")
    shared = (f"{settings['steps']} steps of {settings['prompts_per_step']} prompts x {settings['n']} samples "
              f"({settings['steps'] * samples} samples), {settings['max_new_tokens']} new tokens at temperature "
              f"{settings['temperature']}, lr {settings['lr']}, {settings['model']}, held-out greedy accuracy on "
              f"{settings['eval_size']} problems")
    return "\n".join(lines) + f"\n\nSettings shared by every row: {shared}."


if __name__ == "__main__":  # a child: python -m rlx.bench.trl SYSTEM OUT_DIR
    chosen, folder = sys.argv[1], Path(sys.argv[2])
    given = Settings(**json.loads((folder / "settings.json").read_text()))
    train = run_trl if chosen.startswith("trl") else run_rlx
    (folder / "result.json").write_text(json.dumps(train(given, chosen, folder)))
