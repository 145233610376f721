"""Spans: what every role did when, on one wall clock across processes (`rlx timeline` draws them).

A span is (name, role, thread, start, end, args). Recording one appends a tuple to a bounded deque
of this process: two `perf_counter` reads and an append, no I/O. Once `open()` names a folder (a
run directory's `timeline/`), a daemon thread appends the buffered spans every second to
`<folder>/<host>-<pid>.jsonl`; a crash loses at most that last second. Unopened, or while the
writer falls behind, the deque keeps the newest `capacity` spans and counts the dropped ones.

Times are `perf_counter` readings of this process (monotonic: spans of one thread nest exactly)
shifted once by the wall clock at import, so spans of different processes line up to within the
hosts' clock agreement.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Self

log = logging.getLogger(__name__)

WALL_OFFSET = time.time() - time.perf_counter()  # perf_counter + this = wall-clock seconds


def run_folder(run_dir: Path) -> Path:
    """Where a run's processes write their spans."""
    return run_dir / "timeline"


def wall_us(counter: float) -> int:
    """A `perf_counter` reading of this process as whole microseconds since the epoch (monotonic)."""
    return round((WALL_OFFSET + counter) * 1e6)


def process_started() -> float:
    """When this process started, as a `perf_counter` reading (negative: before the import)."""
    import psutil  # a dependency of Ray

    return psutil.Process().create_time() - WALL_OFFSET


class Span:
    """`with timeline.span(...) as span:` records on exit (also on an exception); `span.args` may
    gain entries inside the block (how many samples a stream produced)."""

    __slots__ = ("_timeline", "args", "name", "role", "start")

    def __init__(self, timeline: Timeline, name: str, role: str, args: dict[str, Any]) -> None:
        self._timeline, self.name, self.role, self.args = timeline, name, role, args

    def __enter__(self) -> Self:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timeline.add(self.name, self.role, self.start, time.perf_counter(), self.args)


class Timeline:
    """The span recorder of one process (`SPANS`); roles in one process share it."""

    def __init__(self, capacity: int = 1 << 16, flush_s: float = 1.0) -> None:
        self._spans: deque[tuple] = deque(maxlen=capacity)
        self._threads: dict[int, str] = {}  # thread id -> name, read once per thread
        self.dropped = 0
        self.flush_s = flush_s
        self._lock = threading.Lock()  # open, close and flush; never taken while recording
        self._file: Path | None = None
        self._users = 0
        self._stop = threading.Event()
        self._writer: threading.Thread | None = None
        self._warned = False
        self._launched: float | None = None  # see `launch_is_this_run`

    def span(self, name: str, role: str, **args: Any) -> Span:
        return Span(self, name, role, args)

    def add(self, name: str, role: str, start: float, end: float, args: dict[str, Any] | None = None) -> None:
        """Record a span measured by the caller (`perf_counter` readings of this process)."""
        tid = threading.get_ident()
        if tid not in self._threads:
            self._threads[tid] = threading.current_thread().name
        if len(self._spans) == self._spans.maxlen:
            self.dropped += 1
        self._spans.append((name, role, tid, start, end, args))

    def launch_is_this_run(self) -> None:
        """The process was started for the run about to begin (the `rlx` command): that run's
        start-up then counts from the process's start."""
        self._launched = process_started()

    def record_launch(self, role: str = "driver") -> None:
        """A `launch` span from the process's start to now (the interpreter, imports, config and run
        directory), if the process was started for this run; a run in a longer-lived process (a
        notebook, a test) has none."""
        if self._launched is not None:
            self.add("launch", role, self._launched, time.perf_counter())
            self._launched = None

    def open(self, folder: Path, process: str) -> None:
        """Write this process's spans into `folder` from now on, as `process` (a label such as
        "colocated", "driver", "rollout-<replica>"). Spans recorded before belong to no run and are
        dropped. Services sharing a process open it once each; it stays open until the last closes."""
        with self._lock:
            self._users += 1
            if self._users > 1 and self._file is not None and self._file.parent == folder:
                self._header(process)
                return
            self._users = 1
            self._spans.clear()
            self._file = folder / f"{socket.gethostname()}-{os.getpid()}.jsonl"
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                self._warn(f"spans stay in memory: cannot create {folder} ({error})")
                self._file = None
                return
            self._header(process)
            if self._writer is None:
                self._stop.clear()
                self._writer = threading.Thread(target=self._write_forever, name="rlx-timeline", daemon=True)
                self._writer.start()

    def close(self) -> None:
        """Write what is buffered; the last user stops the writer thread."""
        with self._lock:
            self._users = max(0, self._users - 1)
            last = self._users == 0
        if last and self._writer is not None:
            self._stop.set()
            self._writer.join(timeout=10)
            self._writer = None
        self.flush()
        if last:
            with self._lock:
                self._file = None

    def flush(self) -> int:
        """Append the buffered spans to this process's file; returns how many were written."""
        with self._lock:
            if self._file is None:
                return 0
            spans = [self._spans.popleft() for _ in range(len(self._spans))]
            dropped, self.dropped = self.dropped, 0
            lines = [json.dumps({"name": name, "role": role, "tid": tid, "thread": self._threads.get(tid, str(tid)),
                                 "t0": wall_us(start), "t1": wall_us(end), "args": args or {}}, default=str)
                     for name, role, tid, start, end, args in spans]
            if dropped:
                lines.append(json.dumps({"dropped": dropped}))
            self._append(lines)
            return len(spans)

    def records(self) -> list[tuple]:
        """The spans buffered now, oldest first (tests, and a look from a debugger)."""
        return list(self._spans)

    def _header(self, process: str) -> None:
        self._append([json.dumps({"process": process, "host": socket.gethostname(), "pid": os.getpid()})])

    def _append(self, lines: list[str]) -> None:
        if not lines or self._file is None:
            return
        try:
            with self._file.open("a") as handle:
                handle.write("\n".join(lines) + "\n")
        except OSError as error:  # observability never takes a run down
            self._warn(f"cannot write spans to {self._file} ({error})")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("timeline: %s", message)

    def _write_forever(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()


SPANS = Timeline()  # this process's recorder
