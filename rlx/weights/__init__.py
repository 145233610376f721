"""DCS, the weight-sync service: versioned weights from the Actor to every engine, without disk."""

from rlx.weights.sync import CHANNELS, WeightPublisher, WeightSubscriber, WeightSync, WeightSyncTimeout

__all__ = ["CHANNELS", "WeightPublisher", "WeightSubscriber", "WeightSync", "WeightSyncTimeout"]
