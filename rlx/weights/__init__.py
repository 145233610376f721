"""DCS, the weight-sync service: versioned weights from the Actor to every engine, without disk.

The clients (`rlx.weights.sync`) need Ray; they load on first use, so the pure bucket code
(`rlx.weights.buckets`) imports without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHANNELS", "Fetched", "WeightPublisher", "WeightReader", "WeightSubscriber", "WeightSync",
           "WeightSyncTimeout"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rlx.weights import sync

        return getattr(sync, name)
    raise AttributeError(f"module 'rlx.weights' has no attribute {name!r}")
