"""Rewards: built-in rule scorers, custom `module:function` rewards, and safe scoring."""

from __future__ import annotations

import importlib
import logging
import re
import sys

from rlx.errors import ConfigError
from rlx.rewards.builtin import DEFAULT_FORMAT, REWARDS, RewardFn
from rlx.rewards.judge import JUDGE_PARSERS, JudgeParser
from rlx.rewards.pool import PooledReward, RewardPool, RewardSpec, confinement_problem
from rlx.rewards.safe import RewardOutcome, outcome_of, score_group_safely, score_safely

# rlx's own string matching, which never evaluates the text it reads; every other scorer (reasoning-gym's
# scorers eval or sympy-parse some answers, math_verify can run for minutes, user code and user patterns)
# runs in the killable reward pool
IN_PROCESS_BUILTINS = frozenset({"exact_match", "multiple_choice", "format", "environment"})
UNCONFINED_SWITCH = "reward.allow_unconfined"
log = logging.getLogger(__name__)


def pool_confinement(allow_unconfined: bool) -> bool:
    """Whether reward pools confine their processes: always where this host can; where it cannot,
    they run unconfined only with `reward.allow_unconfined: true`, else the run refuses to start
    (fails closed: every pooled score would otherwise fail, or run the model's text unconfined)."""
    problem = confinement_problem()
    if problem is None:
        return True
    if not allow_unconfined:
        raise ConfigError(f"{problem}. Rewards that read model text (reasoning_gym, math_verify, custom rewards and "
                          "parsers) run in confined processes: enable unprivileged user namespaces (or run as root with "
                          f"CAP_SYS_ADMIN), or set {UNCONFINED_SWITCH}=true to run them unconfined (they keep their "
                          "deadline but can reach the network and this user's files)")
    log.warning("%s; %s=true: reward processes run unconfined", problem, UNCONFINED_SWITCH)
    return False


def load_custom_reward(spec: str, key: str = "reward.name") -> RewardFn:
    """`package.module:function` from the working directory or an installed package; `key` names the setting."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{key}={spec!r}: cannot load {attr!r} from module {module_name!r}: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r} is not callable")
    return fn


def build_judge_parser(spec: str, allow_unconfined: bool = False) -> JudgeParser:
    """A built-in parser, or `module:function` as a PooledReward: user code reading the judge's text
    (which quotes the policy's) runs in the reward pool, as custom rewards do."""
    if ":" in spec:
        fn = load_custom_reward(spec, "reward.judge.parser")
        return PooledReward(RewardSpec(spec, "none", None, tuple(sys.path)), fn, pool_confinement(allow_unconfined))
    if spec not in JUDGE_PARSERS:
        raise ConfigError(f"reward.judge.parser={spec!r} is unknown; use one of {JUDGE_PARSERS.names()} or module:function")
    return JUDGE_PARSERS.get(spec)


def build_reward(name: str, extract: str, format_pattern: str | None = None, allow_unconfined: bool = False
                 ) -> RewardFn:
    """A built-in reward by name, or `package.module:function` (called as fn(completion, label, metadata)).

    Every reward but rlx's own string matching comes back as a `PooledReward`, which `score_safely`
    runs in a process pool: custom functions, reasoning_gym, math_verify, and format with a user
    pattern (rlx.rewards.pool). Model text reaches them, and some evaluate it: the pool confines its
    processes, or, where this host cannot, refuses unless `allow_unconfined` (`pool_confinement`).
    """
    fn = build_reward_fn(name, extract, format_pattern)
    user_pattern = name == "format" and format_pattern not in (None, DEFAULT_FORMAT)
    if name not in IN_PROCESS_BUILTINS or user_pattern:
        spec = RewardSpec(name, extract, format_pattern, tuple(sys.path))
        return PooledReward(spec, fn, pool_confinement(allow_unconfined))
    return fn


def build_reward_fn(name: str, extract: str, format_pattern: str | None = None) -> RewardFn:
    """The reward function itself, to call in this process (a pool process builds it with this)."""
    if name == "genrm":
        raise ConfigError("reward.name=genrm is a judge role, not a function: build it with the GenRM role")
    if ":" in name:
        return load_custom_reward(name)
    if name not in REWARDS:
        raise ConfigError(f"reward.name={name!r} is unknown; use one of {REWARDS.names()} or module:function")
    if name == "format" and format_pattern is not None:
        try:
            return REWARDS.get(name)(extract, format_pattern)
        except re.error as exc:
            raise ConfigError(f"reward.format_pattern={format_pattern!r} is not a valid regex: {exc}") from None
    return REWARDS.get(name)(extract)


__all__ = ["JUDGE_PARSERS", "REWARDS", "PooledReward", "RewardFn", "RewardOutcome", "RewardPool",
           "RewardSpec", "build_judge_parser", "build_reward", "build_reward_fn", "load_custom_reward",
           "outcome_of", "pool_confinement", "score_group_safely", "score_safely"]
