"""Rewards for the streaming tests: one sample's reward is slow; the clock says when it finished.

Custom rewards run in a pool process, so the time goes to the file `metadata["finished_to"]`
(time.monotonic is one clock for every process on Linux)."""

import time
from pathlib import Path


def slow_for_group_zero(completion: str, label: str, metadata: dict) -> float:
    if metadata.get("slow"):
        time.sleep(3.0)
        Path(metadata["finished_to"]).write_text(repr(time.monotonic()))
    return completion.count(label) / max(1, len(completion))
