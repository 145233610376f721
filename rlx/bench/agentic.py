"""Colocate vs async on identical multi-turn work whose tool calls take wall time without CPU.

Every trajectory is `tool_calls + 1` policy turns: each of the first `tool_calls` turns is answered
by a real calculator call through a `ToolBox` with `extra_latency_s` (a fixed wall-time wait that
uses no CPU, standing in for a remote sandbox or web API), the last turn ends the episode. A
random-init model cannot write a tool call, so the bench environment (`ToolTurns`) treats every
turn before the last as one: the calls, their latency and their metrics are real, only the
decision to call is scripted. Turns end on one of many frequent characters, so they are short
(a few tokens, as a tool call is cheap next to its latency) and never cut.

Same model, prompts, samples per step, steps, engine, sampling settings, PPO epochs and
trajectory concurrency in every mode; the modes run one after the other in one process. The
default work balances the phases of a colocated step: the Rollout's (mostly waiting on tools)
and the Actor's (2 PPO epochs) take comparable time, which is when colocate leaves the cores
idle and an async schedule can overlap them.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import psutil
import requests

from rlx.agents.environments import Environment, EnvStep
from rlx.agents.tools import ToolBox, build_tool
from rlx.agents.trajectory import ToolCallRecord
from rlx.bench.pipeline import summarize
from rlx.config import RunConfig, build_config
from rlx.data.rows import PromptRow
from rlx.models.tiny import build_tiny, char_tokenizer
from rlx.obs.metrics import read_metrics

MODES = (("colocate", 0), ("async", 1), ("async", 2))


class ToolTurns(Environment):
    """Answers each of the first `tool_calls` turns with a calculator call on the row's expression
    that takes `tool_latency_s` of wall time; the next turn ends the episode."""

    def __init__(self, tool_calls: int = 2, tool_latency_s: float = 1.0) -> None:
        self.tool_calls, self.made = tool_calls, 0
        self.toolbox = ToolBox([build_tool("calculator")], extra_latency_s=tool_latency_s)
        self.expression = ""

    def reset(self, row: PromptRow) -> list[dict]:
        self.expression = row.metadata["expression"]
        return [{"role": "user", "content": row.prompt}]

    def step(self, action: str) -> EnvStep:
        if self.made == self.tool_calls:
            return EnvStep(done=True)
        self.made += 1
        result = self.toolbox.call("calculator", {"expression": self.expression})
        return EnvStep([{"role": "tool", "content": result.text}],
                       tool_calls=[ToolCallRecord("calculator", result.outcome, result.latency_s)])

    def close(self) -> None:
        self.toolbox.close()


@dataclass(frozen=True)
class Work:
    """How much work one step is; the same in every mode."""

    prompts_per_step: int = 8
    n: int = 8
    tool_calls: int = 3
    tool_latency_s: float = 1.0
    concurrency: int = 192  # trajectories in flight: 3 steps' worth, all that max_staleness=2 admits
    hidden: int = 256
    layers: int = 4
    ppo_epochs: int = 2
    actor_threads: int = 2
    turn_stops: str = "abcdefghijklmnopqrstuvwxyz0123456789 "  # end a policy turn: about 3 tokens a turn

    def describe(self) -> str:
        return (f"Work per step: {self.prompts_per_step} prompts x {self.n} trajectories, each "
                f"{self.tool_calls + 1} policy turns and {self.tool_calls} calculator calls of "
                f"{self.tool_latency_s:g} s wall time without CPU; a random-init Llama {self.hidden} wide, "
                f"{self.layers} layers; {self.ppo_epochs} PPO epochs; up to {self.concurrency} trajectories in "
                f"flight. Colocate runs every phase on 2 threads; async gives the Actor {self.actor_threads}, "
                f"the Rollout and ActorFwd 1 each.")


def write_prompts(path: Path, count: int = 512) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append({"prompt": f"Add {a} and {b}.", "label": str(a + b),
                     "metadata": {"expression": f"{a}+{b}"}})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def bench_config(mode: str, staleness: int, work_dir: Path, model: Path, data: Path, steps: int,
                 work: Work) -> RunConfig:
    agent = {"environment": f"{__name__}:ToolTurns", "max_turns": work.tool_calls + 1,
             "environment_options": {"tool_calls": work.tool_calls, "tool_latency_s": work.tool_latency_s},
             "max_trajectory_tokens": 256, "concurrency": work.concurrency}
    return build_config({
        "model": {"path": str(model)},
        "data": {"source": "jsonl", "path": str(data), "eval_size": 0},
        "rollout": {"n": work.n, "prompts_per_step": work.prompts_per_step, "max_new_tokens": 48,
                    "max_batch_size": work.concurrency, "agent": agent,
                    "stop_token_ids": char_tokenizer().convert_tokens_to_ids(list(work.turn_stops))},
        "reward": {"name": "exact_match", "extract": "none"},
        "algorithm": {"filter_zero_std_groups": False},
        "train": {"mode": mode, "max_staleness": staleness, "steps": steps, "lr": 1e-5, "micro_batch_size": 16,
                  "eval_every": 0, "ppo_epochs": work.ppo_epochs},
        "resources": {"num_threads": 2, "rollout": {"threads": 1, "num_cpus": 1},
                      "actor": {"threads": work.actor_threads, "num_cpus": 1}, "actor_fwd": {"threads": 1}},
        "logging": {"run_dir": str(work_dir / f"agentic-{mode}-s{staleness}"), "progress_bar": False},
    })


class BusyProbe:
    """Steady-state busy fractions of an async run's roles, read through its management API.

    The run's metrics hold each role's busy fraction since it started, start-up included (the
    Actor idles until the first trajectories finish). Each replica's status has its busy seconds
    and that fraction, so busy / fraction is its own elapsed time at that beat: the difference
    between two beats is exact in the replica's clock, however late the poll read them."""

    def __init__(self, run_dir: Path, every_s: float = 0.5) -> None:
        self.run_dir, self.every_s = run_dir, every_s
        self.samples: list[tuple[int, dict[str, tuple[float, float]]]] = []  # (driver step, role -> busy, elapsed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="rlx-bench-busy-probe", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                url = json.loads((self.run_dir / "api.json").read_text())["url"]
                token = (self.run_dir / "api_token").read_text()
                status = requests.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"},
                                      timeout=5).json()
            except (OSError, ValueError, KeyError, requests.RequestException):
                continue  # not up yet, or already gone
            clocks = {role: (s[0]["busy_s"], s[0]["busy_s"] / s[0]["busy_fraction"])
                      for role, s in status.get("roles", {}).items() if s and 0 < s[0]["busy_fraction"] < 1}
            self.samples.append((status["step"], clocks))

    def busy(self, role: str, first_step: int, last_step: int) -> float:
        """`role`'s busy fraction from the first poll at `first_step` to the last before `last_step`.
        A worker books busy time when a unit ends (a trajectory, a micro-batch), so each end of the
        window can be off by one unit; over many steps that is a few percent, and 1 is the cap."""
        window = [clocks[role] for step, clocks in self.samples if first_step <= step < last_step and role in clocks]
        if len(window) < 2 or window[-1][1] <= window[0][1]:
            raise RuntimeError(f"the busy probe saw too little of steps {first_step}-{last_step} of {self.run_dir}")
        (busy0, clock0), (busy1, clock1) = window[0], window[-1]
        return min(1.0, (busy1 - busy0) / (clock1 - clock0))


class CpuShare:
    """Cores used during one mode by this benchmark's processes (the bench and its Ray cluster) and
    by everything else on the machine: on a shared machine, the second is the load to report."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self.first: dict[tuple[int, float], float] = {}  # (pid, start time) -> CPU seconds when the mode began
        self.last: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="rlx-bench-cpu-share", daemon=True)

    def __enter__(self) -> Self:
        self.started_epoch, self.started, self.machine = time.time(), time.monotonic(), _machine_busy_s()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        wall_s = time.monotonic() - self.started
        self.own_cores = sum(self.last[key] - self.first[key] for key in self.last) / wall_s
        self.other_cores = max(0.0, (_machine_busy_s() - self.machine) / wall_s - self.own_cores)

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def _sample(self) -> None:
        """A process started during the mode counts from zero; one that exits between two samples
        loses at most its last `every_s` of CPU time."""
        me = psutil.Process()
        for process in [me, *me.children(recursive=True)]:
            try:
                with process.oneshot():
                    started, times = process.create_time(), process.cpu_times()
            except psutil.Error:
                continue  # exited meanwhile
            key, used = (process.pid, started), times.user + times.system
            self.first.setdefault(key, 0.0 if started >= self.started_epoch else used)
            self.last[key] = used


def _machine_busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


def agent_summary(config: RunConfig) -> dict[str, float]:
    steps = [r for r in read_metrics(config.run_dir) if "reward_mean" in r]
    keys = ("agent_turns_mean", "agent_tool_calls_mean", "agent_tool_latency_mean_s", "agent_cut_fraction")
    return {key: sum(r[key] for r in steps) / len(steps) for key in keys}


def run_agentic_benchmark(work_dir: Path, steps: int = 10, work: Work = Work(),
                          modes: tuple[tuple[str, int], ...] = MODES) -> list[dict]:
    from rlx.orchestration.async_run import run_async
    from rlx.orchestration.colocate import run_colocate

    work_dir.mkdir(parents=True, exist_ok=True)
    model = build_tiny(work_dir / "agentic-model", hidden=work.hidden, layers=work.layers, heads=8, seed=0)
    data = write_prompts(work_dir / "agentic-prompts.jsonl")
    results = []
    for mode, staleness in modes:
        config = bench_config(mode, staleness, work_dir, model, data, steps, work)
        start = time.perf_counter()
        if mode == "colocate":
            with CpuShare() as cpu:
                run_colocate(config, overwrite=True, echo=lambda _: None)
            row = summarize(config, time.perf_counter() - start)
        else:
            with CpuShare() as cpu, BusyProbe(config.run_dir) as probe:
                run_async(config, overwrite=True, echo=lambda _: None)
            row = summarize(config, time.perf_counter() - start)
            row.update({f"busy_{role}": probe.busy(role, 1, steps) for role in ("actor", "rollout")})
        results.append({**row, **agent_summary(config), "own_cores": cpu.own_cores, "other_cores": cpu.other_cores})
    base = results[0]["samples_per_s"]
    for row in results:
        row["speedup"] = row["samples_per_s"] / base
    return results


def actor_bound(results: list[dict]) -> str:
    """No schedule trains faster than the Actor computes: colocate's train phase is the Actor alone
    on every core, so async can shorten colocate's step to that at best."""
    colocate = results[0]
    train_s = colocate["step_s"] * colocate["busy_actor"]
    return (f"Bound: a colocated step is {colocate['step_s']:.2f} s, of which the Actor trains {train_s:.2f} s "
            f"alone on every core; async cannot step faster than the Actor trains, so it can beat colocate "
            f"by at most {colocate['step_s'] / train_s:.2f}x with this work.")


def format_table(results: list[dict], work: Work = Work()) -> str:
    lines = [("| mode | samples/s | speed-up | s/step | busy actor | idle actor | busy rollout | turns | "
              "tool calls | tool latency (s) | cores: this run | cores: other jobs |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['samples_per_s']:.1f} | {r['speedup']:.2f}x | {r['step_s']:.2f} | "
                     f"{r['busy_actor']:.2f} | {1 - r['busy_actor']:.2f} | {r['busy_rollout']:.2f} | "
                     f"{r['agent_turns_mean']:.1f} | {r['agent_tool_calls_mean']:.1f} | "
                     f"{r['agent_tool_latency_mean_s']:.2f} | {r['own_cores']:.2f} | {r['other_cores']:.2f} |")
    lengths = ", ".join(f"{r['mode']}: {r['response_length']:.0f}" for r in results)
    return (work.describe() + "\n\n" + "\n".join(lines)
            + f"\n\nMean trajectory length (policy and tool tokens) per mode: {lengths}.\n\n" + actor_bound(results))
