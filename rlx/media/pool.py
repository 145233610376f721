"""Media processing in a pool of processes (`data.processor_workers`): each prompt group's media
are decoded and turned into model inputs in a process of the pool, the groups a step (or a refill)
starts in parallel with each other; the engine thread waits for them.

The pool's processes build the same processor as the rollout would (`processor_for`, from the
model's config and `data`), so the inputs are identical; a row the processor refuses raises the
same DataError, naming the row. A process that dies is replaced, and the row tried once more on a
new one; a row whose media hang past PROCESS_TIMEOUT_S fails with a DataError naming it.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rlx.errors import DataError
from rlx.isolation import ChildProcess, ProcessCrash, ProcessFailure, ProcessPool, self_destruct_after

if TYPE_CHECKING:
    from rlx.config import DataConfig
    from rlx.data.rows import PromptRow
    from rlx.media.inputs import MediaInputs

START_TIMEOUT_S = 120.0  # starting a process and importing transformers
PROCESS_TIMEOUT_S = 600.0  # one row's media: a long video decodes for a while


class _ProcessorProcess(ChildProcess):
    def __init__(self) -> None:
        super().__init__("rlx.media.processor_process", "media processor")
        self.opened = False


class MediaProcessorPool:
    """A MediaProcessor (rlx.media.processor) whose work runs in up to `workers` processes."""

    def __init__(self, model_config: Any, data: DataConfig, workers: int) -> None:
        from rlx.media.processor import processor_for

        local = processor_for(model_config, data)  # checks the model takes media
        self.placeholder_ids, self.media_token_ids = local.placeholder_ids, local.media_token_ids
        self.limits = data.media_limits
        self._open = (model_config, data)
        self.workers = workers
        self.pool: ProcessPool[_ProcessorProcess] = ProcessPool(_ProcessorProcess, workers, "media processor")
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="rlx-media")

    def __call__(self, prompt_ids: list[int], row: PromptRow) -> tuple[list[int], MediaInputs]:
        try:
            status, value = self._process(prompt_ids, row)
        except ProcessCrash:  # its process died (killed while idle, out of memory): once more, on a new one
            try:
                status, value = self._process(prompt_ids, row)
            except ProcessFailure as failure:
                raise DataError(f"{row.source}: processing its media failed twice: {failure}") from None
        except ProcessFailure as failure:
            raise DataError(f"{row.source}: processing its media failed: {failure}") from None
        if status == "data_error":
            raise DataError(value)
        return pickle.loads(value)

    def _process(self, prompt_ids: list[int], row: PromptRow) -> tuple[str, Any]:
        child = self.pool.checkout()
        try:
            child.started(START_TIMEOUT_S)
            if not child.opened:
                child.request(("open", self._open, self_destruct_after(START_TIMEOUT_S)), START_TIMEOUT_S,
                              f"the media processor did not start within {START_TIMEOUT_S}s")
                child.opened = True
            return child.request(("process", (prompt_ids, row), self_destruct_after(PROCESS_TIMEOUT_S)),
                                 PROCESS_TIMEOUT_S, f"{row.source}: its media took over {PROCESS_TIMEOUT_S}s")
        finally:
            self.pool.checkin(child)

    def map(self, items: Sequence[tuple[list[int], PromptRow]]) -> list[tuple[list[int], MediaInputs]]:
        """Each (prompt_ids, row), in order, processed in parallel over the pool."""
        return list(self._threads.map(lambda item: self(*item), items))

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self.pool.close()
