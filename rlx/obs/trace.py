"""`rlx timeline RUN_DIR`: the spans under `RUN_DIR/timeline/` as a Chrome trace and a Gantt chart.

`timeline.json` opens in Perfetto or chrome://tracing: one process per process of the run, one
row ("thread") per lane. `timeline.png` is a Gantt chart: one row per role and process, its lanes
as stripes, a colour per span name, nested spans thinner on their parents, the Actor's weight
versions marked.

A lane holds threads of one role in one process: each thread joins the first lane none of whose
spans it overlaps (colocated mode runs the Rollout's generation on the main thread and its weight
loads on the Actor's helper thread: one lane; eight reward threads scoring at once: as many lanes
as overlap). Spans within a lane are disjoint or nested, never partially overlapping.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlx.errors import UserError
from rlx.obs.timeline import run_folder

ROLE_ORDER = ("driver", "rollout", "reward", "critic", "teacher", "advantages", "reference", "actor_fwd", "actor")
COLOURS = {"generate": "#1f77b4", "score": "#ff7f0e", "advantages": "#2ca02c", "forward": "#9467bd",
           "train": "#d62728", "publish": "#8c564b", "load_weights": "#e377c2", "checkpoint": "#bcbd22",
           "evaluate": "#17becf", "start": "#aec7e8", "wait": "#c7c7c7", "launch": "#dbdb8d",
           "load_data": "#9edae5", "substrate": "#c49c94"}
SPARE_COLOURS = ("#7f7f7f", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5")


@dataclass
class SpanRecord:
    name: str
    role: str
    thread: str
    t0: int  # wall-clock microseconds
    t1: int
    args: dict[str, Any]
    depth: int = 0  # how many spans of its lane enclose it


@dataclass
class Lane:
    process: int  # index into `Trace.processes`
    role: str
    index: int  # among the role's `count` lanes in this process
    count: int
    spans: list[SpanRecord] = field(default_factory=list)
    where: str = ""  # " @ <process>" when the role has lanes in several processes

    @property
    def row(self) -> str:
        """The chart's row: all the role's lanes in one process, one stripe each."""
        return self.role + self.where + (f" x{self.count}" if self.count > 1 else "")

    @property
    def label(self) -> str:
        return self.role + (f" {self.index + 1}" if self.count > 1 else "") + self.where


@dataclass
class Trace:
    processes: list[str]  # labels
    lanes: list[Lane]
    dropped: int  # spans a process could not keep (its writer fell behind)

    @property
    def spans(self) -> list[SpanRecord]:
        return [s for lane in self.lanes for s in lane.spans]

    @property
    def start(self) -> int:
        return min((s.t0 for s in self.spans), default=0)


def read_process_file(path: Path) -> tuple[str, dict[tuple[str, int], list[SpanRecord]], int]:
    """One process's label, its spans by (role, thread id), and its dropped count. A line cut short
    by a crash is skipped."""
    labels: list[str] = []
    threads: dict[tuple[str, int], list[SpanRecord]] = defaultdict(list)
    dropped = 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "process" in record:
            labels.append(record["process"])
        elif "dropped" in record:
            dropped += record["dropped"]
        else:
            threads[(record["role"], record["tid"])].append(
                SpanRecord(record["name"], record["role"], record["thread"], record["t0"], record["t1"],
                           record["args"]))
    label = ", ".join(dict.fromkeys(labels)) or path.stem
    return f"{label} ({path.stem})", threads, dropped


def _union(spans: list[SpanRecord]) -> list[tuple[int, int]]:
    """The intervals a thread's spans cover, merged, in order."""
    merged: list[tuple[int, int]] = []
    for s in sorted(spans, key=lambda s: s.t0):
        if merged and s.t0 < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], s.t1))
        else:
            merged.append((s.t0, s.t1))
    return merged


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] < b[j][1] and b[j][0] < a[i][1]:
            return True
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return False


def _set_depths(spans: list[SpanRecord]) -> None:
    spans.sort(key=lambda s: (s.t0, -s.t1))
    open_ends: list[int] = []
    for s in spans:
        while open_ends and open_ends[-1] <= s.t0:
            open_ends.pop()
        s.depth = len(open_ends)
        open_ends.append(s.t1)


def _lanes(process: int, role: str, threads: list[list[SpanRecord]]) -> list[Lane]:
    packed: list[tuple[list[tuple[int, int]], list[SpanRecord]]] = []
    for spans in sorted(threads, key=lambda spans: min(s.t0 for s in spans)):
        covered = _union(spans)
        for lane in packed:
            if not _overlap(lane[0], covered):
                lane[0][:] = sorted(lane[0] + covered)
                lane[1].extend(spans)
                break
        else:
            packed.append((covered, list(spans)))
    for _, spans in packed:
        _set_depths(spans)
    return [Lane(process, role, index, len(packed), spans) for index, (_, spans) in enumerate(packed)]


def role_rank(role: str) -> int:
    return ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER)


def read_trace(run_dir: Path) -> Trace:
    folder = run_folder(run_dir)
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    if not files:
        raise UserError(f"{run_dir} has no spans in {folder}: is it a run directory of an rlx run "
                        "(runs record spans since `rlx timeline` exists)?")
    processes, lanes, dropped = [], [], 0
    roles_in: dict[str, int] = defaultdict(int)
    for path in files:
        label, threads, lost = read_process_file(path)
        dropped += lost
        by_role: dict[str, list[list[SpanRecord]]] = defaultdict(list)
        for (role, _), spans in threads.items():
            by_role[role].append(spans)
        for role, role_threads in by_role.items():
            lanes.extend(_lanes(len(processes), role, role_threads))
            roles_in[role] += 1
        processes.append(label)
    for lane in lanes:  # a role in several processes (replicas, the driver's evaluator) says which
        if roles_in[lane.role] > 1:
            lane.where = f" @ {processes[lane.process].split(' (')[0]}"
    lanes.sort(key=lambda lane: (role_rank(lane.role), lane.role, lane.process, lane.index))
    return Trace(processes, lanes, dropped)


def chrome_trace(trace: Trace) -> dict[str, Any]:
    """Chrome trace JSON: "M" events name each process and lane, "X" events are the spans (us)."""
    start = trace.start
    events: list[dict[str, Any]] = []
    for pid, label in enumerate(trace.processes, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
    for tid, lane in enumerate(trace.lanes, start=1):
        pid = lane.process + 1
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane.label}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for s in lane.spans:
            events.append({"ph": "X", "name": s.name, "cat": lane.role, "pid": pid, "tid": tid, "ts": s.t0 - start,
                           "dur": s.t1 - s.t0, "args": {"thread": s.thread, **s.args}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"start_unix_us": start, "dropped_spans": trace.dropped}}


def startup_parts(trace: Trace) -> tuple[list[tuple[str, float]], float | None]:
    """Start-up part by part: `("<span> <role>", seconds)` for every outermost span that began before
    the first generation, in start order, and the seconds from the first of them (the launch) to
    that generation (None if there was none)."""
    first = min((s.t0 for s in trace.spans if s.name == "generate"), default=None)
    parts = sorted((s for s in trace.spans if s.depth == 0 and s.name not in ("wait", "generate")
                    and (first is None or s.t0 < first)), key=lambda s: s.t0)
    return ([(f"{s.name} {s.role}", (s.t1 - s.t0) / 1e6) for s in parts],
            None if first is None else (first - trace.start) / 1e6)


def step_marks(trace: Trace) -> list[tuple[float, int]]:
    """(seconds since the start, version) where each new weight version was published."""
    return sorted(((s.t1 - trace.start) / 1e6, s.args.get("version", 0)) for s in trace.spans
                  if s.name == "publish" and s.role == "actor")


def plot_timeline(trace: Trace, out: Path, title: str, window: tuple[float, float] | None = None) -> Path:
    """The Gantt chart; `window`: only these seconds since the first span (a long run's few steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = sorted({s.name for s in trace.spans}, key=lambda n: (list(COLOURS).index(n) if n in COLOURS else 99, n))
    spare = iter(SPARE_COLOURS * len(names))
    colours = {n: COLOURS.get(n) or next(spare) for n in names}
    row_labels = list(dict.fromkeys(lane.row for lane in trace.lanes))
    rows = len(row_labels)
    fig, ax = plt.subplots(figsize=(14, 1.6 + 0.38 * rows))
    start = trace.start
    left, right = window or (0.0, (max(s.t1 for s in trace.spans) - start) / 1e6)
    for lane in trace.lanes:
        stripe = 0.8 / lane.count
        centre = rows - 1 - row_labels.index(lane.row) + 0.4 - stripe * (lane.index + 0.5)
        for depth in sorted({s.depth for s in lane.spans}):
            by_name: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for s in lane.spans:
                at = (s.t0 - start) / 1e6
                if s.depth == depth and at <= right and (s.t1 - start) / 1e6 >= left:
                    by_name[s.name].append((at, (s.t1 - s.t0) / 1e6))
            for name, bars in by_name.items():
                height = stripe * (0.35 if name == "wait" else 0.9) * 0.6 ** depth
                ax.broken_barh(bars, (centre - height / 2, height), facecolors=colours[name],
                               edgecolor=colours[name], linewidth=0.4)
    labelled = float("-inf")
    for at, version in step_marks(trace):
        if not left <= at <= right:
            continue
        ax.axvline(at, color="black", linestyle=":", linewidth=0.7, alpha=0.6)
        if at - labelled >= (right - left) / 40:  # labels that would overlap are left out
            ax.text(at, rows - 0.45, f"v{version}", fontsize=7, ha="center", va="bottom")
            labelled = at
    margin = (right - left) / 100
    ax.set_xlim(left - margin, right + margin)
    ax.set_yticks(range(rows), list(reversed(row_labels)))
    ax.set_ylim(-0.6, rows - 0.1 + 0.35)
    ax.set_xlabel("seconds since the first span  (dotted: the Actor published weight version vN)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=colours[n], label=n) for n in names], loc="upper left",
              bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_timeline(run_dir: Path, window: tuple[float, float] | None = None) -> tuple[Path, Path, Trace]:
    """`RUN_DIR/timeline.json` and `RUN_DIR/timeline.png` (of `window` only, if given) from the spans
    under `RUN_DIR/timeline/`."""
    trace = read_trace(run_dir)
    json_path = run_dir / "timeline.json"
    json_path.write_text(json.dumps(chrome_trace(trace)))
    processes = len(trace.processes)
    title = f"{run_dir.name}: {len(trace.spans)} spans from {processes} process{'es' if processes > 1 else ''}"
    if trace.dropped:
        title += f" ({trace.dropped} dropped)"
    return json_path, plot_timeline(trace, run_dir / "timeline.png", title, window), trace
