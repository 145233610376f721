"""One generation engine on a thread of its own, fed one request at a time.

An engine's `stream` takes a batch and yields results as they finish. Callers that produce
requests one by one and at their own pace (an agent loop waiting on tool calls, an HTTP handler)
submit them to an `EngineLoop` instead: `submit` returns a `Future` at once, and the loop batches
whatever is waiting. Requests with equal sampling params decode together, and requests that arrive
mid-batch join it through the engine's `refill` (continuous batching), so a caller that submits
its next turn as soon as the last one returns never waits for a whole batch to drain.

Everything else that touches the engine (weight loads) goes through `call`, which runs on the same
thread between decode steps: it never races a forward pass. `pause` holds decoding, with every
request in flight kept where it is, until `resume`; calls still run while paused.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from rlx.engines.generation.base import GenerationRequest, GenerationResult, SamplingParams
from rlx.media.inputs import RowMedia

T = TypeVar("T")


class RefillingEngine(Protocol):
    """What the loop needs of an engine: `stream` with `refill` and `between_steps` (hf, vllm and
    sglang all have them) and a batch size to fill."""

    max_batch_size: int

    def stream(self, requests: list[GenerationRequest], params: SamplingParams,
               refill: Callable[[int], list[GenerationRequest]] | None = None,
               between_steps: Callable[[], None] | None = None) -> Iterator[GenerationResult]: ...


class EngineLoopStopped(RuntimeError):
    """The loop has stopped: raised by `submit` and `call`, and set on every request still waiting."""


@dataclass
class _Job:
    prompt_ids: list[int]
    params: SamplingParams
    future: Future
    media: RowMedia | None = None


class EngineLoop:
    """Runs `engine` on one daemon thread; `submit` and `call` are safe from any thread.

    `decode_steps` and `peak_batch` (most requests ever decoding together) show how well requests
    were batched."""

    def __init__(self, engine: RefillingEngine) -> None:
        self.engine = engine
        self.decode_steps = 0
        self.peak_batch = 0
        self._ids = itertools.count()
        self._jobs: deque[_Job] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._paused = self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rlx-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               media: RowMedia | None = None) -> Future[GenerationResult]:
        """Queue one request (`media`: the model inputs of the media its placeholders stand for);
        its future holds the result (or the engine's error) once it finishes. Cancelling the future
        before it starts decoding drops the request."""
        job = _Job(prompt_ids, params, Future(), media)
        with self._cond:
            self._check_running()
            self._jobs.append(job)
            self._cond.notify_all()
        return job.future

    def run_on_engine_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread (between decode steps) and return its result."""
        future: Future = Future()
        with self._cond:
            self._check_running()
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future.result()

    def pause(self) -> None:
        """Stop decoding after the current step; requests in flight keep their place (and cache)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stop(self) -> None:
        """Finish the current decode step, then fail whatever is still waiting with EngineLoopStopped."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        for future in [job.future for job in self._jobs] + [future for _, future in self._calls]:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineLoopStopped("the engine loop stopped before this request ran"))

    def _check_running(self) -> None:
        if self._stopping:
            raise EngineLoopStopped("the engine loop has stopped; start a new one")

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._calls or (self._jobs and not self._paused))
                if self._stopping:
                    return
            self._run_calls()
            jobs = self._take(None, self.engine.max_batch_size)
            if jobs:
                self._decode(jobs)

    def _run_calls(self) -> None:
        while True:
            with self._cond:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as error:  # noqa: BLE001 - handed to the caller
                    future.set_exception(error)

    def _take(self, params: SamplingParams | None, limit: int) -> list[_Job]:
        """Up to `limit` waiting jobs with these params (any params: the oldest job's)."""
        with self._cond:
            if self._paused or self._stopping or not self._jobs:
                return []
            params = params or self._jobs[0].params
            taken, kept = [], deque()
            for job in self._jobs:
                (taken if job.params == params and len(taken) < limit else kept).append(job)
            self._jobs = kept
            return taken

    def _decode(self, jobs: list[_Job]) -> None:
        params = jobs[0].params
        futures: dict[int, Future] = {}

        def admit(batch: list[_Job]) -> list[GenerationRequest]:
            requests = []
            for job in batch:
                if job.future.set_running_or_notify_cancel():  # False: the caller cancelled it
                    request_id = next(self._ids)
                    futures[request_id] = job.future
                    requests.append(GenerationRequest(request_id, job.prompt_ids, job.media))
            self.peak_batch = max(self.peak_batch, len(futures))
            return requests

        try:
            results = self.engine.stream(admit(jobs), params, refill=lambda free: admit(self._take(params, free)),
                                         between_steps=self._between_steps)
            for result in results:
                futures.pop(result.request_id).set_result(result)
        except Exception as error:  # noqa: BLE001 - every waiting request gets the error
            for future in futures.values():
                future.set_exception(error)

    def _between_steps(self) -> None:
        self.decode_steps += 1
        while True:
            self._run_calls()
            with self._cond:
                if self._stopping:
                    raise EngineLoopStopped("the engine loop stopped while this request was decoding")
                if not self._paused:
                    return
                self._cond.wait_for(lambda: self._calls or not self._paused or self._stopping)
