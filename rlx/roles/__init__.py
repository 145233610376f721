"""RL roles as plain Python classes. Orchestration wraps them (in-process or as services);
they never import Ray Serve and never call each other."""

from rlx.roles.actor import Actor
from rlx.roles.advantages import Advantages
from rlx.roles.critic import Critic
from rlx.roles.genrm import GenRM
from rlx.roles.reference import ActorFwd, Reference
from rlx.roles.reward import Reward
from rlx.roles.rollout import Rollout

__all__ = ["Actor", "ActorFwd", "Advantages", "Critic", "GenRM", "Reference", "Reward", "Rollout"]
