"""A media processor process: turns rows' media into model inputs for a rollout's processor pool
(rlx.media.pool), so decoding and patching run in parallel across groups.

Run as `python -m rlx.media.processor_process FD` (rlx.isolation: requests in the main thread).
Ops: "open" (model config, DataConfig) builds the processor (`processor_for`); "process"
(prompt_ids, row) returns the pickled (ids, inputs), or ("data_error", message) for a row the
processor refuses, which the parent raises as the same DataError.
"""

from __future__ import annotations

import pickle
import sys
from multiprocessing.connection import Connection
from typing import Any

from rlx.errors import DataError
from rlx.isolation import serve_requests


def serve(conn: Connection) -> None:
    from rlx.media.processor import processor_for

    processor = None

    def handle(op: str, payload: Any) -> Any:
        nonlocal processor
        if op == "open":
            processor = processor_for(*payload)
            return None
        assert processor is not None, "process before open"
        try:
            # pickled here: the connection's pickler would send tensors as shared-memory handles
            return "ok", pickle.dumps(processor(*payload))
        except DataError as exc:
            return "data_error", str(exc)

    serve_requests(conn, handle)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
