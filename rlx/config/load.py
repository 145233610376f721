"""Reading a `RunConfig`: YAML, dotted overrides, moved keys, and validation errors in users' words."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlx.config.algorithm import LOSS_CONFIGS, AlgorithmConfig
from rlx.config.base import parse_yaml
from rlx.config.run import RunConfig
from rlx.errors import ConfigError

MOVED_KEYS = {
    "algorithm.policy_loss": "algorithm.loss.type",
    **{f"algorithm.{key}": f"algorithm.loss.{key} (with algorithm.loss.type=clipped, the default)"
       for key in ("clip_low", "clip_high", "dual_clip")},
    **{f"algorithm.{loss}_{key}": f"algorithm.loss.{key} (with algorithm.loss.type={loss})"
       for loss, keys in (("gspo", ("clip_low", "clip_high")), ("sapo", ("tau_pos", "tau_neg")),
                          ("cispo", ("clip_low", "clip_high"))) for key in keys},
    "model.dtype": "rollout.dtype (generation) and train.param_dtype (training, Reference, Teacher, ActorFwd)",
    "train.autocast_bf16": "train.param_dtype (bfloat16: bf16 autocast over float32 weights)",
}


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `a.b.c=value` pairs into a nested dict; values are parsed as YAML scalars/lists."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. train.lr=1e-6)")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[leaf] = parse_yaml(text) if text else ""
    return raw


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model: Any = RunConfig
    for part in map(str, loc[:-1]):
        if isinstance(model, dict):  # inside the loss union, pydantic names the member by its tag
            model = model[part]
            continue
        annotation = model.model_fields[part].annotation
        if model is AlgorithmConfig and part == "loss":
            model = LOSS_CONFIGS
            continue
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _user_loc(loc: tuple[Any, ...]) -> tuple[str, ...]:
    """The key path as users write it: without the tag pydantic adds (algorithm.loss.gspo.clip_low)."""
    return tuple(str(p) for i, p in enumerate(loc) if not (i and loc[i - 1] == "loss" and p in LOSS_CONFIGS))


def _describe(error: dict[str, Any]) -> str:
    loc = tuple(error["loc"])
    if not loc:  # a cross-field check: its message names the keys itself
        return error["msg"].removeprefix("Value error, ")
    path = _user_loc(loc)
    key = ".".join(path)
    if error["type"] == "extra_forbidden" and key in MOVED_KEYS:
        return f"{key} moved to {MOVED_KEYS[key]}"
    if error["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc)
        close = difflib.get_close_matches(path[-1], allowed, n=1)
        hint = f" Did you mean {'.'.join(path[:-1] + (close[0],))!r}?" if close else ""
        owners = [kind for kind, section in LOSS_CONFIGS.items() if path[-1] in section.model_fields]
        if path[:2] == ("algorithm", "loss") and owners:
            hint += f" {path[-1]} is a key of algorithm.loss.type={' or '.join(owners)}."
        return f"unknown key {key!r}.{hint} Allowed here: {', '.join(allowed)}"
    return f"{key} = {error.get('input')!r}: {error['msg']}"


def build_config(raw: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [_describe(e) for e in exc.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def read_yaml_mapping(path: str | Path | None, what: str = "config file") -> dict[str, Any]:
    """The mapping a YAML file holds (empty for no file); any other content is a ConfigError naming `what`."""
    if path is None:
        return {}
    try:
        raw = parse_yaml(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {str(path)!r} must hold a mapping of keys, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    return build_config(apply_overrides(read_yaml_mapping(path), list(overrides)))
