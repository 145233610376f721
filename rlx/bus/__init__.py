"""The field-level data bus: rows are samples, fields are columns written by different roles.

`LocalBus` keeps values in-process (colocated mode, tests); `rlx.bus.ray_bus.Bus` keeps them in
Ray's object store with the index in one actor. Both share `BusIndex` and the samplers.
"""

from rlx.bus.core import BusFull, BusIndex, BusTimeout
from rlx.bus.local import LocalBus
from rlx.bus.samplers import GroupSampler, SequentialSampler, TokenBudgetSampler, make_sampler

__all__ = ["BusFull", "BusIndex", "BusTimeout", "GroupSampler", "LocalBus", "SequentialSampler",
           "TokenBudgetSampler", "make_sampler"]
