"""Rewards for the streaming tests: one sample's reward is slow; the clock says when it finished."""

import time

FINISHED: dict[str, float] = {}


def slow_for_group_zero(completion: str, label: str, metadata: dict) -> float:
    if metadata.get("slow"):
        time.sleep(3.0)
        FINISHED["slow"] = time.monotonic()
    return completion.count(label) / max(1, len(completion))
