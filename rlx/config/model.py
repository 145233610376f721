"""The `model` section: the policy's initial weights."""

from __future__ import annotations

from pydantic import Field

from rlx.config.base import Section


class ModelConfig(Section):
    path: str = Field("smollm2-135m-instruct", description="a built-in model name (`rlx models list`) or a HF folder")
