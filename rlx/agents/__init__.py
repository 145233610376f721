"""Agentic rollouts: environments, tools and multi-turn trajectories built token in and token out.

Kept light on import: the trainer reads `rlx.agents.trajectory` for its metrics; the rollout
machinery (`rlx.agents.loop`) and the tools load where a run uses them.
"""

from rlx.agents.environments import ENVIRONMENTS, Environment, EnvStep
from rlx.agents.parsers import PARSERS, ParsedTurn, ToolCall
from rlx.agents.trajectory import ToolCallRecord, Trajectory

__all__ = ["ENVIRONMENTS", "PARSERS", "EnvStep", "Environment", "ParsedTurn", "ToolCall", "ToolCallRecord",
           "Trajectory"]
