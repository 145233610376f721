"""`SFTConfig`: the settings of one supervised fine-tuning run, from YAML plus `key=value` overrides.

Flat on purpose (an SFT stage has one model, one data file and one output), checked as strictly
as the RL config: every key has a type and a range, and an unknown key is an error naming the
keys allowed.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlx.config import apply_overrides, read_yaml_mapping
from rlx.errors import ConfigError


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field("smollm2-135m-instruct", description="starting model: a built-in name (`rlx models list`) "
                       "or a Hugging Face folder")
    data: str = Field(description="JSONL file, one conversation per line: {\"messages\": [...], \"tools\"?: [...]}")
    output: str = Field(description="folder for the fine-tuned model and tokenizer; `rlx train model.path=<it>` "
                        "starts from it")
    overwrite: bool = Field(False, description="replace `output` if it holds an earlier rlx sft result")
    epochs: int = Field(1, ge=1, description="passes over the conversations")
    batch_size: int = Field(8, ge=1, description="conversations per optimizer step")
    micro_batch_size: int = Field(8, ge=1, description="conversations per forward/backward (memory bound only: "
                                  "the update does not depend on it)")
    max_length: int = Field(1024, ge=2, description="tokens per conversation; longer ones are cut at the end "
                            "(and counted)")
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0.0)
    param_dtype: Literal["float32", "bfloat16"] = Field("float32", description="bfloat16: bf16 autocast over "
                                                        "float32 weights, as train.param_dtype")
    device: Literal["cpu", "cuda"] = "cpu"
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; default: all cores")
    seed: int = Field(0, description="the order of conversations in every epoch")


def _describe(error: dict) -> str:
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        allowed = list(SFTConfig.model_fields)
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"unknown key {key!r}.{hint} Allowed: {', '.join(allowed)}"
    if error["type"] == "missing":
        return f"{key} is required ({SFTConfig.model_fields[key].description}): set {key}=..."
    return f"{key} = {error.get('input')!r}: {error['msg']}"


def load_sft_config(path: str | Path | None, overrides: list[str] = ()) -> SFTConfig:
    """An SFTConfig from an optional YAML file and `key=value` overrides (YAML scalars, as `rlx train`)."""
    raw = read_yaml_mapping(path, "sft config file")
    try:
        return SFTConfig.model_validate(apply_overrides(raw, list(overrides)))
    except ValidationError as exc:
        raise ConfigError("invalid sft config:\n  " + "\n  ".join(_describe(e) for e in exc.errors())) from None
