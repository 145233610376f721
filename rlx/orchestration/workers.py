"""Workers connect a role to the bus: read its input fields, run the role, write its output fields.

The same workers run serially (colocated mode calls `drain`/`train_step` in order) or each on its
own thread in its own service (async mode calls `run_forever`). Roles stay unaware of either.
"""

from __future__ import annotations

import abc
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from fractions import Fraction
from pathlib import Path
from typing import Any

from rlx.bus.core import BusTimeout
from rlx.bus.loader import StreamingDataLoader
from rlx.data.rows import PromptRow
from rlx.data.sample import Sample
from rlx.engines.generation.base import SamplingParams
from rlx.obs.timeline import SPANS
from rlx.orchestration.faults import StepFaults
from rlx.orchestration.prompt_source import PromptSource
from rlx.orchestration.reports import Cursor, StepReports, batch_metrics
from rlx.orchestration.run_dir import checkpoint_path
from rlx.orchestration.staleness import StalenessGate
from rlx.roles import Actor, Advantages, Critic, Reference, Rollout
from rlx.roles.rollout import Group
from rlx.run_state import encode_run_state

SAMPLE_FIELDS = {f.name for f in dataclass_fields(Sample)} - {"uid"}

def to_samples(row_ids: list[int], values: dict[str, list]) -> list[Sample]:
    """One `Sample` per row, from the bus fields read; a field `Sample` lacks is an error, not dropped."""
    unknown = sorted(set(values) - SAMPLE_FIELDS)
    if unknown:
        raise ValueError(f"bus fields {unknown} have no attribute on Sample (rlx/data/sample.py): declare each "
                         "one there beside its FieldSpec in rlx/orchestration/plan.py")
    return [Sample(uid=row, **{name: column[i] for name, column in values.items()}) for i, row in enumerate(row_ids)]


def sample_tokens(sample: Sample) -> int:
    return len(sample.prompt_ids) + len(sample.response_ids)


@dataclass(frozen=True)
class Checkpointing:
    """A stateful worker that checkpoints itself (async mode): every `every` of its own steps into
    `run_dir`, with `capture()`, the run state that must be saved beside the model. Off by default."""

    run_dir: Path | None = None
    every: int = 0
    capture: Callable[[], dict[str, Any]] = dict

    def due(self, step: int) -> bool:
        return bool(self.every and self.run_dir and step % self.every == 0)


NO_CHECKPOINTS = Checkpointing()  # colocated mode: the loop checkpoints every role at once


class Worker(abc.ABC):
    """Busy/idle accounting plus an optional background loop; `error` holds what killed the loop."""

    poll_timeout_s = 0.2

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_s = 0.0
        self.started_at = time.monotonic()
        self.items = 0
        self.error: str | None = None
        self.last_beat = time.monotonic()
        self.hung = False  # fault injection: the loop blocks without a heartbeat
        self.injected_error: Exception | None = None  # fault injection: the loop raises this next
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_stop: list[Callable[[], None]] = []  # resources to release with the worker (a weight subscription)
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rlx-{name}-wait")  # `_beating_while`
        self._waiting_since: float | None = None  # `perf_counter` of the first of the empty polls since the last work

    @abc.abstractmethod
    def work_once(self) -> int:
        """Do one unit of work if any is ready; return how many items it processed."""

    def beat(self) -> bool:
        """Record progress (the hang watchdog reads `last_beat`); False once asked to stop."""
        self.last_beat = time.monotonic()
        return not self._stop.is_set()

    def drain(self) -> int:
        """Process everything ready now, without waiting for more (colocated mode)."""
        total, self.poll_timeout_s = 0, 0.0
        while (done := self.work_once()) > 0:
            total += done
        self._waiting_since = None  # the loop runs the next role now: this one is not waiting
        return total

    def _timed(self, fn: Callable[[], Any], span: str | None = None, **args: Any) -> Any:
        """Run `fn` as busy time; `span` names it on the timeline (`rlx.obs.timeline`)."""
        start = time.monotonic()
        try:
            if span is None:
                return fn()
            with SPANS.span(span, self.name, **args):
                return fn()
        finally:
            self.busy_s += time.monotonic() - start

    def _waited(self, since: float, got_work: bool) -> None:
        """Book a bus wait: the thread waits from its first empty poll until a poll brings work,
        one span however many polls that took."""
        if self._waiting_since is None:
            self._waiting_since = since
        if got_work:
            SPANS.add("wait", self.name, self._waiting_since, time.perf_counter())
            self._waiting_since = None

    def _waiting_for(self, batches: Iterable[Any]) -> Iterator[Any]:
        """`batches` (a data loader that blocks until rows are ready), each wait for one on the timeline."""
        batches = iter(batches)
        while True:
            with SPANS.span("wait", self.name):
                batch = next(batches, None)
            if batch is None:
                return
            yield batch

    def _poll(self, task: str, fields: list[str], size: int, **kwargs: Any) -> tuple[list[int], dict[str, list]]:
        """`bus.poll` for `task`, its waiting time on the timeline."""
        since = time.perf_counter()
        rows, values = self.bus.poll(task, fields, size, self.poll_timeout_s, **kwargs)
        self._waited(since, bool(rows))
        return rows, values

    def _beating_while(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on a helper thread and keep beating until it returns: for a wait with a timeout
        of its own (a weight publication while the coordinator is replaced), which is no hang."""
        future = self._helper.submit(fn)
        while not wait([future], timeout=0.5).done:
            self.beat()
        return future.result()

    def run_forever(self) -> None:
        self.started_at = time.monotonic()

        def loop():
            try:
                while self.beat():
                    while self.hung and not self._stop.is_set():
                        time.sleep(0.2)
                    if self.injected_error is not None:
                        raise self.injected_error
                    self.work_once()
            except Exception as exc:  # noqa: BLE001 - surfaced through status() and the service health check
                self.error = f"{type(exc).__name__}: {exc}"

        self._thread = threading.Thread(target=loop, name=f"rlx-{self.name}", daemon=True)
        self._thread.start()

    def hang(self) -> None:
        """Fault injection: stop working and stop beating, as a deadlocked call would."""
        self.hung = True

    def fail(self, error: Exception) -> None:
        """Fault injection: the loop raises `error` before its next unit of work, as an
        out-of-memory error in the role would."""
        self.injected_error = error

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for release in self.on_stop:
            release()

    def status(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started_at, 1e-9)
        return {"name": self.name, "items": self.items, "busy_s": self.busy_s,
                "busy_fraction": min(1.0, self.busy_s / elapsed), "error": self.error}


def response_shares(values: dict[str, list], rows: int) -> list[Fraction]:
    """Each row's share of a response of its group: 1, or 1/k for each of the k samples of an agent
    app's episode (exact, so k shares make one). Steps count responses, so a step takes
    `prompts_per_step` groups' worth whatever their rows (the staleness gate admits groups per
    version); a step that took more than its count (its last row a whole response where a share was
    missing) takes that much less in the next."""
    return [Fraction(1, k) for k in values["episode_rows"]] if "episode_rows" in values else [Fraction(1)] * rows


class RewardWorker(Worker):
    """Scores samples concurrently and writes each reward as soon as it is known, so one slow
    reward call delays only its own unit (a sample, a group, or a judge's batch), never the rest.

    `unit` is "sample" (rule and custom per-sample rewards), "group" (custom group rewards) or
    "batch" (GenRM: one batched generation per call, one call at a time).
    """

    def __init__(self, role: Any, bus, inputs: list[str], outputs: list[str], unit: str = "sample",
                 group_size: int = 1, batch_size: int = 32, concurrency: int = 8) -> None:
        super().__init__("reward")
        self.role, self.bus, self.unit, self.group_size = role, bus, unit, group_size
        self.inputs, self.outputs = inputs, outputs
        self.batch_size, self.concurrency = batch_size, 1 if unit == "batch" else concurrency
        self.pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="rlx-reward")
        self.in_flight: set[Future] = set()
        # scoring threads finish (queued units are dropped) before the Reward role's process pool ends
        self.on_stop.append(lambda: self.pool.shutdown(wait=True, cancel_futures=True))
        self.on_stop.append(role.close)

    def status(self) -> dict[str, Any]:
        """Adds the reward function's failures so far, by class (error, timeout, crash, bad_value)."""
        failures = {f"reward_failed_{kind}": count for kind, count in self.role.failures.items()}
        return {**super().status(), **failures}

    def _score(self, rows: list[int], samples: list[Sample]) -> None:
        self._timed(lambda: self.role.score(samples), "score", rows=len(rows))
        self.bus.put_fields(rows, {name: [getattr(s, name) for s in samples] for name in self.outputs})
        self.items += len(rows)

    def _units(self, rows: list[int], samples: list[Sample]) -> list[tuple[list[int], list[Sample]]]:
        if self.unit == "batch":
            return [(rows, samples)] if rows else []
        if self.unit == "sample":
            return [([row], [sample]) for row, sample in zip(rows, samples)]
        by_group: dict[int, tuple[list[int], list[Sample]]] = {}
        for row, sample in zip(rows, samples):
            unit = by_group.setdefault(sample.group_id, ([], []))
            unit[0].append(row)
            unit[1].append(sample)
        return list(by_group.values())

    def work_once(self) -> int:
        """Hand newly ready units to the pool; return how many rows finished or started since the last call."""
        for future in [f for f in self.in_flight if f.done()]:
            self.in_flight.discard(future)
            future.result()  # a bus failure inside a scoring thread stops this worker too
        finished_before = self.items
        room = self.concurrency - len(self.in_flight)
        rows: list[int] = []
        if room > 0:
            size = {"sample": room, "group": room * self.group_size, "batch": self.batch_size}[self.unit]
            sampler = ("group", self.group_size) if self.unit == "group" else None
            rows, values = self._poll("reward", self.inputs, size, sampler=sampler, partial=True)
            for unit_rows, unit_samples in self._units(rows, to_samples(rows, values) if rows else []):
                self.in_flight.add(self.pool.submit(self._score, unit_rows, unit_samples))
        if not rows and self.in_flight:
            wait(self.in_flight, timeout=self.poll_timeout_s, return_when=FIRST_COMPLETED)
        return self.items - finished_before + len(rows)

    def drain(self) -> int:
        total = 0
        while (done := super().drain()) > 0 or self.in_flight:
            total += done
            wait(self.in_flight)
        return total


class AdvantagesWorker(Worker):
    """Whole groups in, advantages out; groups dropped for equal rewards are counted on the bus,
    where dynamic sampling's admission control reads them."""

    def __init__(self, role: Advantages, bus, group_size: int, inputs: list[str], outputs: list[str],
                 groups_per_batch: int = 8) -> None:
        super().__init__("advantages")
        self.role, self.bus, self.inputs, self.outputs = role, bus, inputs, outputs
        self.group_size, self.groups_per_batch = group_size, groups_per_batch
        self.dropped_groups = 0

    def work_once(self) -> int:
        rows, values = self._poll("advantages", self.inputs, self.group_size * self.groups_per_batch,
                                  sampler=("group", self.group_size), partial=True)
        if not rows:
            return 0
        samples = to_samples(rows, values)
        result = self._timed(lambda: self.role.compute(samples), "advantages", rows=len(rows))
        self.bus.put_fields(rows, {name: [getattr(s, name) for s in samples] for name in self.outputs})
        if result.dropped_groups:
            self.dropped_groups += result.dropped_groups
            self.bus.count("groups_dropped", result.dropped_groups)
        self.items += len(rows)
        return len(rows)


class CriticWorker(Worker):
    """The Critic's two jobs, interleaved without blocking either: values for new samples (which
    advantages wait on) and training steps on samples whose returns are known."""

    def __init__(self, role: Critic, bus, rows_per_step: int, micro_batch_size: int, final_tasks: list[str],
                 value_inputs: list[str], train_inputs: list[str],
                 checkpoints: Checkpointing = NO_CHECKPOINTS) -> None:
        """`checkpoints`: async mode, where the Critic checkpoints itself on its own clock."""
        super().__init__("critic")
        self.role, self.bus, self.final_tasks = role, bus, final_tasks
        self.value_inputs, self.train_inputs = value_inputs, train_inputs
        self.lock = threading.RLock()  # a checkpoint asked from outside waits for the current unit of work
        self.rows_per_step, self.micro_batch_size = rows_per_step, micro_batch_size
        self.remaining: Fraction | None = None  # responses left in the open training step (`response_shares`)
        self.overshoot = Fraction(0)  # what the last step took beyond its count: the next takes less
        self.reports = StepReports()
        self.checkpoints = checkpoints

    def _values(self) -> int:
        rows, values = self._poll("critic", self.value_inputs, self.micro_batch_size, partial=True)
        if rows:
            out = self._timed(lambda: self.role.values(to_samples(rows, values)), "forward", rows=len(rows))
            self.bus.put_fields(rows, {"values": out})
        return len(rows)

    def _train(self) -> int:
        if self.remaining is None:
            self.role.begin_step()
            self.remaining = self.rows_per_step + self.overshoot
        rows, values = self._poll("critic_train", self.train_inputs,
                                  min(self.micro_batch_size, math.ceil(self.remaining)), partial=True)
        if not rows:
            return 0
        trainable = [s for s in to_samples(rows, values) if s.filter_reason is None]
        if trainable:
            self._timed(lambda: self.role.accumulate(trainable), "train", step=self.role.version + 1,
                        rows=len(trainable))
        self.bus.clear_consumed(self.final_tasks)
        self.remaining -= sum(response_shares(values, len(rows)))
        if self.remaining <= 0:
            self.overshoot = self.remaining
            metrics = self._timed(self.role.finish_step, "train", step=self.role.version + 1, phase="optimizer")
            self.remaining = None
            step = self.role.version
            self.reports.add({**metrics, "critic_step": float(step)})
            if self.checkpoints.due(step):
                self._timed(self.save_checkpoint)
        self.items += len(rows)
        return len(rows)

    def work_once(self) -> int:
        with self.lock:
            return self._values() + self._train()

    def save_checkpoint(self) -> None:
        """The value model and its optimizer at the Critic's own step, into `checkpoints/critic/`."""
        if self.checkpoints.run_dir is not None:
            with self.lock, SPANS.span("checkpoint", self.name, step=self.role.version):
                self.role.save(checkpoint_path(self.checkpoints.run_dir, self.role.version, "critic"), {})

    def reported_after(self, cursor: Cursor | None) -> list[tuple[Cursor, dict[str, float]]]:
        """The Critic's finished steps the driver does not hold yet (see `StepReports`)."""
        return self.reports.after(cursor)


class LogProbWorker(Worker):
    """Forward-only log-probs of each sample's response (Reference and ActorFwd: trainable ones only;
    Teacher: all, since advantages need them). `output` receives the log-probs; a
    `proximal_version` among `outputs` records the weight version they were computed with (ActorFwd)."""

    def __init__(self, name: str, role: Reference, bus, batch_size: int, inputs: list[str], output: str,
                 outputs: list[str], before_batch: Callable[[], None] = lambda: None) -> None:
        super().__init__(name)
        self.role, self.bus, self.batch_size = role, bus, batch_size
        self.inputs, self.output, self.outputs, self.before_batch = inputs, output, outputs, before_batch

    def work_once(self) -> int:
        rows, values = self._poll(self.name, self.inputs, self.batch_size, partial=True)
        if not rows:
            return 0
        self.before_batch()
        samples = to_samples(rows, values)
        trainable = [s for s in samples if s.filter_reason is None]
        logprobs = iter(self._timed(lambda: self.role.logprobs(trainable), "forward", rows=len(trainable))
                        if trainable else [])
        written = {self.output: [next(logprobs) if s.filter_reason is None else None for s in samples]}
        if "proximal_version" in self.outputs:
            written["proximal_version"] = [self.role.weight_version] * len(samples)
        self.bus.put_fields(rows, written)
        self.items += len(rows)
        return len(rows)


class RolloutWorker(Worker):
    """Generates prompt groups under admission control and streams each finished sample to the bus.

    Groups come from a PromptSource shared by every rollout replica. In async mode one `work_once`
    is a long continuous-batching stream: whenever batch slots free up, new groups join as far as
    the staleness gate allows, and newer weights are loaded between decode steps. A group is
    reported finished to the source once all its samples are on the bus.
    """

    dropped_check_every_steps = 16  # reading the dropped-group count is a round trip to the bus

    def __init__(self, role: Rollout, bus, source: PromptSource, encode: Callable[[PromptRow], list[int]], n: int,
                 sampling: Callable[[int], SamplingParams], sync_weights: Callable[[], Any], max_batch_size: int,
                 fields: list[str], refill_dropped: bool = False, consumer: str = "rollout",
                 group_fields: frozenset[str] = frozenset()) -> None:
        """`group_fields`: those of `fields` stored once per group on the bus (e.g. media inputs)."""
        super().__init__("rollout")
        self.fields = [name for name in fields if name not in group_fields]
        self.group_fields = [name for name in fields if name in group_fields]
        self.role, self.bus, self.source, self.encode, self.n = role, bus, source, encode, n
        self.sampling, self.sync_weights, self.max_batch_size = sampling, sync_weights, max_batch_size
        self.refill_dropped, self.consumer = refill_dropped, consumer
        self._version, self._steps, self._dropped = 0, 0, 0
        self._pending: Counter = Counter()  # group id -> samples still to come
        self._started: set[int] = set()  # groups with a sample on the bus
        self._rows: Counter = Counter()  # group id -> its rows, once an episode of several samples grew it
        self._grown: defaultdict[int, set[int]] = defaultdict(set)  # group id -> episodes that grew it

    def _refresh(self, check_dropped: bool = True) -> None:
        self.sync_weights()  # applies a version the subscriber already received: no round trip
        # Admission counts against the weights this engine actually generates with: counting against
        # a newer published version the engine has not loaded yet would let staleness exceed the bound.
        self._version = self.role.version
        if self.refill_dropped and check_dropped:  # dynamic sampling: a dropped group frees its place
            self._dropped = int(self.bus.metrics().get("bus_groups_dropped", 0))

    def _between_steps(self) -> None:
        self.beat()
        self._steps += 1
        self._refresh(check_dropped=self._steps % self.dropped_check_every_steps == 0)

    def _groups(self, issued: list[tuple[int, PromptRow]]) -> list[Group]:
        self._pending.update({group_id: self.n for group_id, _ in issued})
        return [(group_id, row, self.encode(row)) for group_id, row in issued]

    def admit(self, max_groups: int) -> list[Group]:
        """Up to `max_groups` groups, as many as the staleness gate allows now (none once stopping:
        the groups in flight finish, so a replica removed by scale-in hands nothing back)."""
        if self._stop.is_set():
            return []
        return self._groups(self.source.take(max_groups, self.consumer, self._version, self._dropped))

    def _produce(self, groups: list[Group], continuous: bool) -> int:
        params = self.sampling(groups[0][0])  # seeded by the first group's position: reproducible

        produced = 0
        mark = time.monotonic()  # busy time is booked per sample: one continuous stream can last a whole run
        with SPANS.span("generate", self.name, groups=len(groups)) as span:  # a whole stream: async, one per run
            for sample in self.role.generate(groups, self.n, params, more_groups=self.admit if continuous else None,
                                             between_steps=self._between_steps if continuous else None):
                group = sample.group_id
                if group not in self._started:
                    self._started.add(group)
                    if self.group_fields:
                        self.bus.put_group(group, {name: getattr(sample, name) for name in self.group_fields},
                                           rows=self.n)
                self._grow(sample)
                self.bus.put({name: [getattr(sample, name)] for name in self.fields}, group_ids=[group],
                             num_tokens=[sample_tokens(sample)])
                self._pending[group] -= 1
                if self._pending[group] == 0:
                    del self._pending[group], self._rows[group]  # a Counter's del skips a missing key
                    self._grown.pop(group, None)
                    self._started.discard(group)
                    self.bus.flush()  # the group is reported done only once the bus has all of it
                    self.source.finished(self.consumer, [group])
                produced += 1
                self.items += 1
                now = time.monotonic()
                self.busy_s, mark = self.busy_s + now - mark, now
            span.args["samples"] = produced
        self.busy_s += time.monotonic() - mark
        return produced

    def _grow(self, sample: Sample) -> None:
        """The first sample of an episode that made several: its group has that many rows more, on
        the bus before they come, so no group sampler takes the group as whole at `n` rows."""
        group = sample.group_id
        if sample.episode_rows > 1 and sample.episode not in self._grown[group]:
            self._grown[group].add(sample.episode)
            self._pending[group] += sample.episode_rows - 1
            self._rows[group] = (self._rows[group] or self.n) + sample.episode_rows - 1
            self.bus.put_group(group, {}, rows=self._rows[group])

    def generate(self, num_groups: int) -> int:
        """Colocated mode: sample exactly `num_groups` new groups (admission is the caller's business)."""
        return self._produce(self._groups(self.source.take(num_groups, self.consumer)), continuous=False)

    def status(self) -> dict[str, Any]:
        return {**super().status(), "weight_version": self.role.version,
                "groups_in_flight": len(self._pending)}

    def work_once(self) -> int:
        self._refresh()
        since = time.perf_counter()
        groups = self.admit(max(1, self.max_batch_size // self.n))
        if not groups:
            time.sleep(0.02)  # waiting for the trainer: admission control, not work
        self._waited(since, bool(groups))
        return self._produce(groups, continuous=True) if groups else 0


class ActorWorker(Worker):
    """One optimizer step per `rows_per_step` rows, trained micro-batch by micro-batch as they arrive."""

    def __init__(self, role: Actor, bus, rows_per_step: int, micro_batch_size: int, gate: StalenessGate,
                 fields: list[str], timeout_s: float, publish: Callable[[], None],
                 max_steps: int | None = None, final_tasks: list[str] = ("train",),
                 dynamic_max_rows: int | None = None, group_size: int = 1,
                 checkpoints: Checkpointing = NO_CHECKPOINTS) -> None:
        """`final_tasks`: the last consumers of a row, cleared once all took it. `dynamic_max_rows`
        (dynamic sampling): only trainable rows count toward a step, up to this many rows in all.
        `checkpoints`: async mode, where the trainer checkpoints itself on its own clock."""
        super().__init__("actor")
        self.role, self.bus, self.gate = role, bus, gate
        self.rows_per_step, self.micro_batch_size = rows_per_step, micro_batch_size
        self.fields = fields
        self.timeout_s, self.publish, self.max_steps = timeout_s, publish, max_steps
        self.final_tasks, self.dynamic_max_rows = list(final_tasks), dynamic_max_rows
        self.group_size, self.samples_per_group = group_size, Counter()  # to prove nothing arrives twice
        self.reports = StepReports()  # async mode: the steps `work_once` finished
        self.lock = threading.Lock()  # a checkpoint never sees half a step
        self.checkpoints = checkpoints
        self.step_faults = StepFaults()  # fault injection at the trainer's own step
        self.overshoot = Fraction(0)  # what the last step took beyond its count: the next takes less

    def _loader(self, rows: int | None) -> StreamingDataLoader:
        dynamic = rows is None and self.dynamic_max_rows is not None

        def counts(values: dict[str, list]) -> Fraction:
            """Responses, in shares (see `response_shares`); with dynamic sampling trainable ones only."""
            shares = response_shares(values, len(values["filter_reason"]))
            return sum(share for share, reason in zip(shares, values["filter_reason"]) if reason is None or not dynamic)

        varying = rows is None and "episode_rows" in self.fields
        return StreamingDataLoader(
            self.bus, "train", self.fields, self.micro_batch_size, rows or self.rows_per_step + self.overshoot,
            timeout=self.timeout_s, should_stop=lambda: not self.beat(),
            counts=counts if dynamic or varying else None, max_rows=self.dynamic_max_rows if dynamic else None)

    def train_step(self, rows: int | None = None) -> dict[str, float]:
        """One optimizer step; `rows` fixes how many rows it takes (colocated mode knows what it made)."""
        version = self.role.version
        loader = self._loader(rows)
        seen: list[Sample] = []
        filtered: Counter = Counter()
        trainable: list[Sample] = []  # filled to whole micro-batches: each pass costs a constant besides its rows
        trained = 0

        def accumulate(batch: list[Sample]) -> None:
            self._timed(lambda: self.role.accumulate(batch), "train", step=version + 1, rows=len(batch))

        self.role.begin_step()
        for row_ids, values in self._waiting_for(loader):
            samples = to_samples(row_ids, values)
            for sample in samples:
                if sample.filter_reason is None and not self.gate.is_fresh(sample.behavior_version, version):
                    sample.filter_reason = "stale"
            seen.extend(samples)
            trainable += [s for s in samples if s.filter_reason is None]
            filtered.update(s.filter_reason for s in samples if s.filter_reason is not None)
            while len(trainable) >= self.micro_batch_size:
                accumulate(trainable[: self.micro_batch_size])
                trained += self.micro_batch_size
                trainable = trainable[self.micro_batch_size :]
        if trainable:
            accumulate(trainable)
            trained += len(trainable)
        if rows is None:
            self.overshoot = min(Fraction(0), loader.remaining)
        # with PPO epochs or mini-batches every update runs here: beat through it, it is no hang
        metrics = self._timed(lambda: self._beating_while(self.role.finish_step), "train", step=version + 1,
                              phase="optimizer")
        publish_started = time.monotonic()
        self._timed(lambda: self._beating_while(self.publish), "publish", version=self.role.version)
        metrics["time_publish_s"] = time.monotonic() - publish_started
        # Rows leave the bus only once their step is done: an Actor lost mid-step hands them back.
        self.bus.clear_consumed(self.final_tasks)
        metrics["trainer_step"] = float(self.role.version)  # the driver's step count follows the trainer's
        metrics["finished_at"] = time.time()  # the driver collects steps every few seconds: time them here
        metrics.update(batch_metrics(seen, version), trained_samples=float(trained),
                       **{f"filtered_{reason}": float(count) for reason, count in filtered.items()})
        for sample in seen:  # in responses: an episode of several samples counts once, in shares
            self.samples_per_group[sample.group_id] += 1 if sample.episode_rows == 1 else Fraction(1, sample.episode_rows)
        metrics["total_samples_duplicated"] = float(sum(max(0, c - self.group_size)
                                                        for c in self.samples_per_group.values()))
        self.items += len(seen)
        return metrics

    def work_once(self) -> int:
        if self.max_steps is not None and self.role.version >= self.max_steps:
            time.sleep(0.05)
            return 0
        with self.lock:
            try:
                self.reports.add(self.train_step())
            except BusTimeout:
                if self._stop.is_set():  # asked to stop mid-step: the unfinished step is dropped
                    return 0
                raise
        step = self.role.version
        if self.checkpoints.due(step):
            self._timed(lambda: self.save_checkpoint(str(self.checkpoints.run_dir), {}))
        self.step_faults.after_step(step)
        return self.rows_per_step

    def reported_after(self, cursor: Cursor | None) -> list[tuple[Cursor, dict[str, float]]]:
        """The trainer's finished steps the driver does not hold yet (see `StepReports`)."""
        return self.reports.after(cursor)

    def status(self) -> dict[str, Any]:
        return {**super().status(), "version": self.role.version}

    def save_checkpoint(self, run_dir: str, extra_state: dict[str, Any]) -> str:
        """Between two steps, into `<run_dir>/checkpoints/step_<the trainer's own step>`: the model,
        the optimizer and (async mode) `checkpoints.capture()`, the state of the bus and the prompt source
        taken while the trainer cannot consume, as run-state data files (`rlx.run_state`)."""
        with self.lock, SPANS.span("checkpoint", self.name, step=self.role.version):
            step = self.role.version  # the driver's count may lag: the trainer's is the truth
            run_state = {"samples_per_group": dict(self.samples_per_group), **self.checkpoints.capture()}
            return str(self.role.save(checkpoint_path(Path(run_dir), step), {**extra_state, "loop_step": step},
                                      encode_run_state(run_state)))

    def restore(self, run_state: dict[str, Any]) -> None:
        self.samples_per_group = Counter(run_state["samples_per_group"])
