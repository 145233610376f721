"""What kind of model `model.path` names, known without loading it (no torch, no transformers).

`rlx.config` needs this to resolve `algorithm.routing_replay` and to reject R3 on a dense model
at config time; reading a folder's config.json is all it takes.
"""

from __future__ import annotations

import json
from pathlib import Path

MOE_BUILTINS = frozenset({"smollm2-moe-4x135m", "tiny-moe"})  # built-in names (rlx.models) of MoE models
ROUTE_REPORTING_ENGINES = frozenset({"hf", "vllm", "sglang"})  # engines that return the experts they routed to
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # how families name the count


def is_moe_config(config: dict) -> bool:
    """True for a Hugging Face model config (its JSON as a dict) of a mixture-of-experts model,
    including multimodal ones that keep the language model's config under `text_config`."""
    thinker = config.get("thinker_config") or {}
    for section in (config, config.get("text_config") or {}, thinker.get("text_config") or {}):
        if any((section.get(key) or 0) > 0 for key in EXPERT_COUNT_KEYS) and section.get("num_experts_per_tok"):
            return True
    return False


def is_moe_model(name_or_path: str) -> bool | None:
    """Whether `model.path` is a mixture-of-experts model; None when it cannot be told (a folder
    without a config.json: loading it fails later with its own error)."""
    if name_or_path in MOE_BUILTINS:
        return True
    config = Path(name_or_path) / "config.json"
    if not config.is_file():
        return None if "/" in name_or_path or Path(name_or_path).exists() else False
    return is_moe_config(json.loads(config.read_text()))
