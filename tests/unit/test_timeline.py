"""The span recorder (`rlx.obs.timeline`) and the trace writer (`rlx.obs.trace`)."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from rlx.errors import UserError
from rlx.obs.timeline import Timeline, run_folder
from rlx.obs.trace import read_trace, startup_parts, write_timeline


def lanes_of(trace_json: dict) -> dict[tuple[int, int], list[dict]]:
    """The "X" events of a Chrome trace by (pid, tid), after checking every event is well formed."""
    lanes: dict[tuple[int, int], list[dict]] = defaultdict(list)
    named = {(e["pid"], e["tid"]) for e in trace_json["traceEvents"] if e["name"] == "thread_name"}
    processes = {e["pid"] for e in trace_json["traceEvents"] if e["name"] == "process_name"}
    for event in trace_json["traceEvents"]:
        assert event["ph"] in ("X", "M"), event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert isinstance(event["ts"], int) and event["ts"] >= 0, event
            assert isinstance(event["dur"], int) and event["dur"] >= 0, event
            assert event["name"] and event["cat"] and "thread" in event["args"], event
            assert (event["pid"], event["tid"]) in named and event["pid"] in processes, event
            lanes[(event["pid"], event["tid"])].append(event)
    return lanes


def assert_nested(trace_json: dict) -> None:
    """Within one lane, two spans are disjoint or one holds the other: never a partial overlap."""
    for lane, events in lanes_of(trace_json).items():
        open_ends: list[tuple[int, dict]] = []
        for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1][0] <= event["ts"]:
                open_ends.pop()
            end = event["ts"] + event["dur"]
            assert not open_ends or end <= open_ends[-1][0], (lane, open_ends[-1][1], event)
            open_ends.append((end, event))


def test_a_span_records_name_role_thread_times_and_args():
    timeline = Timeline()
    with timeline.span("outer", "actor", step=3), timeline.span("inner", "actor") as inner:
        inner.args["rows"] = 8
    (i_name, i_role, i_tid, i_start, i_end, i_args), (o_name, _, o_tid, o_start, o_end, o_args) = timeline.records()
    assert (i_name, i_role, i_args, o_name, o_args) == ("inner", "actor", {"rows": 8}, "outer", {"step": 3})
    assert i_tid == o_tid == threading.get_ident()
    assert o_start <= i_start <= i_end <= o_end  # nested exactly: one monotonic clock


def test_a_span_is_recorded_when_its_block_raises():
    timeline = Timeline()
    with pytest.raises(ValueError), timeline.span("train", "actor"):
        raise ValueError("boom")
    assert [r[0] for r in timeline.records()] == ["train"]


def test_memory_is_bounded_and_drops_are_counted(tmp_path):
    timeline = Timeline(capacity=4)
    timeline.open(tmp_path, "p")
    for index in range(10):
        timeline.add("wait", "reward", 0.0, 1.0, {"i": index})
    assert [r[5]["i"] for r in timeline.records()] == [6, 7, 8, 9] and timeline.dropped == 6
    timeline.close()
    lines = [json.loads(line) for line in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    assert lines[-1] == {"dropped": 6} and [line["args"]["i"] for line in lines[1:-1]] == [6, 7, 8, 9]


def test_the_writer_thread_appends_spans_to_one_file_per_process(tmp_path):
    timeline = Timeline(flush_s=0.05)
    timeline.add("before", "actor", 0.0, 1.0)  # before the run's folder is known: no run's span
    timeline.open(tmp_path, "rollout-1")
    timeline.open(tmp_path, "reward-2")  # a second service of this process
    with timeline.span("generate", "rollout"):
        pass
    (path,) = tmp_path.glob("*.jsonl")
    deadline = time.monotonic() + 5
    while "generate" not in path.read_text() and time.monotonic() < deadline:  # no flush asked for
        time.sleep(0.01)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line.get("process") for line in lines[:2]] == ["rollout-1", "reward-2"]
    assert [line["name"] for line in lines[2:]] == ["generate"]
    timeline.close()  # the first service leaves: the other still records
    with timeline.span("score", "reward"):
        pass
    timeline.close()
    assert [json.loads(line).get("name") for line in path.read_text().splitlines()][-1] == "score"
    assert timeline._writer is None
    span = lines[2]
    assert span["t1"] >= span["t0"] > 1.6e15 and span["thread"] == threading.current_thread().name


def test_an_unwritable_folder_keeps_spans_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    timeline = Timeline()
    timeline.open(blocker / "timeline", "p")  # a file where the folder should be
    with timeline.span("x", "r"):
        pass
    timeline.close()
    assert len(timeline.records()) == 1


def record_run(folder: Path) -> None:
    """Two processes' files: a colocated-like one (two roles on one thread, a helper thread, two
    overlapping reward threads) and a replica, written by real recorders."""
    main = Timeline()
    main.open(folder, "colocated")
    with main.span("generate", "rollout"):
        time.sleep(0.002)
    started = threading.Barrier(2)

    def score() -> None:
        with main.span("score", "reward"):
            started.wait()
            time.sleep(0.003)

    scorers = [threading.Thread(target=score, name=f"rlx-reward_{i}") for i in range(2)]
    for thread in scorers:
        thread.start()
    for thread in scorers:
        thread.join()
    with main.span("train", "actor", step=1), main.span("train", "actor", phase="optimizer"):
        time.sleep(0.001)

    def load() -> None:
        with main.span("load_weights", "rollout"):
            pass

    with main.span("publish", "actor", version=1):
        helper = threading.Thread(target=load, name="rlx-actor-wait_0")
        helper.start()
        helper.join()
    main.close()
    replica = Timeline()
    replica.open(folder.parent / "elsewhere", "reward-abc")
    replica.add("wait", "reward", time.perf_counter() - 0.001, time.perf_counter())
    replica.close()
    (path,) = (folder.parent / "elsewhere").glob("*.jsonl")
    path.rename(folder / "other-host-1.jsonl")  # as if another process on another host wrote it


def test_the_trace_names_processes_and_lanes_and_nests_spans(tmp_path):
    record_run(run_folder(tmp_path))
    json_path, png_path, trace = write_timeline(tmp_path)
    trace_json = json.loads(json_path.read_text())
    assert_nested(trace_json)
    names = {(e["pid"], e["args"]["name"]) for e in trace_json["traceEvents"] if e["name"] == "thread_name"}
    labels = sorted(label for _, label in names)
    # the Rollout's main-thread generation and its load on the helper thread share a lane; the
    # two reward threads overlapped: two lanes; the replica's reward lane says where it is
    assert labels == ["actor", "reward 1 @ colocated", "reward 2 @ colocated", "reward @ reward-abc", "rollout"]
    processes = sorted(e["args"]["name"] for e in trace_json["traceEvents"] if e["name"] == "process_name")
    assert processes[0].startswith("colocated (") and processes[1] == "reward-abc (other-host-1)"
    actor = next(lane for lane in trace.lanes if lane.role == "actor")
    assert sorted((s.name, s.depth) for s in actor.spans) == [("publish", 0), ("train", 0), ("train", 1)]
    assert png_path.stat().st_size > 5000
    before = png_path.read_bytes()
    write_timeline(tmp_path, window=(0.0, 0.001))  # the first millisecond only
    assert png_path.read_bytes() != before


def test_a_line_cut_short_by_a_crash_is_skipped(tmp_path):
    record_run(run_folder(tmp_path))
    path = run_folder(tmp_path) / "other-host-1.jsonl"
    path.write_text(path.read_text() + '{"name": "tra')
    assert len(read_trace(tmp_path).spans) == 8


def test_a_run_without_spans_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no spans"):
        write_timeline(tmp_path)


def test_start_up_parts_are_the_outermost_spans_before_the_first_generation(tmp_path):
    timeline = Timeline()
    timeline.record_launch()  # a run in a process not started for it: no launch span
    timeline.launch_is_this_run()
    timeline.open(run_folder(tmp_path), "colocated")
    timeline.record_launch()
    timeline.record_launch()  # once per launch
    with timeline.span("start", "actor"), timeline.span("load_weights", "actor"):
        time.sleep(0.002)
    with timeline.span("generate", "rollout"):
        pass
    with timeline.span("evaluate", "driver"):  # after the first step: not start-up
        pass
    timeline.close()
    parts, first_step_s = startup_parts(read_trace(tmp_path))
    assert [name for name, _ in parts] == ["launch driver", "start actor"]
    launch, start = (seconds for _, seconds in parts)
    assert launch > 0.1  # from this process's start: the interpreter and the imports
    assert start >= 0.002 and first_step_s >= launch + start
