"""DCS, the weight-sync service: versioned weights from the Actor to every engine, without disk."""

from rlx.weights.sync import (
    CHANNELS,
    Fetched,
    WeightPublisher,
    WeightReader,
    WeightSubscriber,
    WeightSync,
    WeightSyncTimeout,
)

__all__ = ["CHANNELS", "Fetched", "WeightPublisher", "WeightReader", "WeightSubscriber", "WeightSync",
           "WeightSyncTimeout"]
