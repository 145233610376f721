"""Rewards for the streaming tests: one sample's reward is slow (the test times its score)."""

import time


def slow_for_group_zero(completion: str, label: str, metadata: dict) -> float:
    if metadata.get("slow"):
        time.sleep(3.0)
    return completion.count(label) / max(1, len(completion))
